"""What the engine knows of a loaded model: sizes, latent layout, and which request fields it uses.

A family's adapter makes its `ModelSpec` in the worker; the engine gets a copy and checks every
request against it before anything is queued, so a field the model would ignore is refused with an
error, and every default a request leaves open is filled in once, here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from rollout.guidance import GUIDANCE_FIELDS  # the fields whose meaning depends on the model
from rollout.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelSpec:
    """A loaded model, as the engine sees it.

    latent_packing: 1 when latents are [C, h, w]; 2 when the pipeline packs 2x2 latent patches into
        channels, [h/2 * w/2, C*4] (FLUX.1, Qwen-Image). Trajectories store the pipeline's own form.
    guidance_defaults: the guidance fields of `SamplingParams` this model uses, with their defaults
        (None: required, unless `guidance_fallbacks` names another field whose value it takes).
        Any other guidance field set on a request is refused.
    guidance_fallbacks: field -> the field whose value it takes when a request leaves it unset
        (Wan 2.2's `guidance_scale_2` defaults to `guidance_scale`, as in its pipeline).
    cfg_field: the field whose value above `cfg_threshold` turns on classifier-free guidance with a
        negative prompt.
    cfg_threshold: 1 where a scale of 1 is the conditional prediction alone (`uncond + s * (cond -
        uncond)`); 0 for Z-Image, whose pipeline guides as `cond + s * (cond - uncond)` when s > 0.
    default_negative_prompt: the negative prompt of a request with CFG that names none (SD3's
        pipeline uses ""); None: such a request must name one.
    default_height, default_width: the size of a request that sets none: its pipeline's, or what
        the model's folder names (`rollout.pipelines.sampling_defaults`: the tiny folders' 32 x 32).
    default_num_frames: None for image models (a request with `num_frames` is refused); likewise
        the pipeline's or the folder's.
    frame_multiple: video models take `num_frames` = k * frame_multiple + 1 (the VAE's temporal
        compression keeps the first frame on its own).
    min_inference_steps: the fewest steps whose schedule is finite (Qwen-Image's scheduler
        stretches its schedule to a terminal sigma, which one step cannot reach).
    max_grid: the most transformer tokens along each axis of the latent grid (height and width
        in patches, and a video's latent frames per temporal patch), as the transformer's
        positional embeddings allow (`max_grid_source` names the config field: SD3's
        pos_embed_max_size, Wan's rope_max_seq_len); None: any size (rotary embeddings made per
        request, as FLUX.1's and Qwen-Image's are).
    temporal_patch_size: latent frames per transformer token (video).
    min_input_images, max_input_images: how many input images (`images=`) a request may carry: 0
        and 0 for a text-to-image family; an edit family's pipeline takes up to `max_input_images`
        as `image=`, and needs at least `min_input_images` (FLUX.1 Kontext: 0 to 1, since its
        pipeline without an image is FLUX.1's text-to-image).
    min_input_image_side, max_input_image_aspect_ratio: the smallest side (0: the size multiple)
        and the largest ratio of the long side to the short one an input image may have, as the
        pipeline checks them (FLUX.2: 64 pixels and 8).
    preferred_input_sizes: (height, width) of the sizes the pipeline resizes an input image to, the
        nearest by aspect ratio, when a request leaves `auto_resize` on (FLUX.1 Kontext's
        PREFERRED_KONTEXT_RESOLUTIONS); empty: the family takes no `auto_resize`.
    default_auto_resize: whether a request that leaves `auto_resize` unset resizes (the pipeline's
        True, unless the folder says otherwise: `rollout.pipelines.sampling_defaults`).
    max_input_image_area: an input image above this many pixels is resized down to it (keeping its
        aspect) before it is encoded, as FLUX.2's pipeline does (None: no such resize).
    edit_area: the pixel count an edit that sets no size is made at, with its input image's aspect
        ratio (Qwen-Image-Edit: a megapixel, its pipeline's `calculate_dimensions`; a folder that
        names a default size makes it that size's area); None: the input image's own size.
    edit_size_image: which input image sets that size (0: the first; -1: the last, as
        Qwen-Image-Edit-Plus's pipeline reads it).
    encoded_image_area: the pixel count each input image is resized to, at its aspect ratio,
        before the VAE encodes it (Qwen-Image-Edit: a megapixel; Plus: its `VAE_IMAGE_SIZE`);
        None: no such resize.
    prompt_reads_images: whether the prompt's encoding reads the request's input images
        (Qwen-Image-Edit's text encoder sees their vision tokens with the prompt), so an encoded
        text is reused only by requests with the same images (`text_key`).
    first_frame: whether the input image is a video's first frame (Wan and LTX-2 image-to-video): resized to
        the request's own size and encoded with its frame count (`image_encoding`), so it takes any
        image size, and a request that sets no size gets the pipeline's default, not the image's.
    first_frame_sizes: (height, width) of the sizes a first frame picks the video's size from, the
        nearest by aspect ratio (HunyuanVideo 1.5 image-to-video: its pipeline takes no size and
        makes the video at the bucket its `calculate_default_height_width` picks); a request must
        leave its size unset or name that one. Empty: the request's own size (Wan).
    takes_max_sequence_length: False where the pipeline has no `max_sequence_length` (Qwen-Image
        2.1 reads whole prompts): a request that sets it is refused.
    pipeline_size_multiple: a multiple the pipeline asks of height and width beside the latent
        grid's (LTX2Pipeline.check_inputs: 32 pixels, whatever its VAE).
    audio_features: a model that makes sound with its video (LTX-2): the audio latents' packed
        features per latent audio frame; 0 for the others. Its latents are one flat vector, the
        video's packed tokens then the audio's packed frames (rollout/pipelines/families/ltx2/adapter.py).
    audio_latents_per_second, frame_rate: latent audio frames per second of video and the frames
        per second it plays at, which give a video's latent audio frames (`audio_latent_frames`).
    audio_sample_rate: samples per second of the decoded waveform (`RolloutOutput.audio`).
    given_latent_frames: the latent frames a video's first frame supplies and its latents leave out
        (LTX-2 image-to-video: the frame's latents are conditioning, at timestep 0, so the state
        holds latent frames 1.. and the audio); 0 where the latents hold every frame (Wan
        image-to-video's first frame is extra channels).
    min_guidance_scale: the smallest `cfg_field` value a request may set (None: any). HunyuanVideo
        1.5's guider guides at any scale but 1, so a scale below 1 (which would guide there, but
        not here, where guidance turns on above `cfg_threshold`) is refused.
    components: the names of the model's components whose weights the hot-swap API reads and
        updates (`update_weights(component=...)`, `weights_checksum(component)`), sorted.
    """

    pipeline_class: str
    latent_channels: int
    vae_scale_factor: int
    patch_size: int
    latent_packing: int
    default_height: int
    default_width: int
    default_max_sequence_length: int
    max_sequence_length_limit: int
    guidance_defaults: dict[str, float | None] = field(default_factory=dict)
    guidance_fallbacks: dict[str, str] = field(default_factory=dict)
    cfg_field: str | None = None
    cfg_threshold: float = 1.0
    default_negative_prompt: str | None = None
    default_num_frames: int | None = None
    frame_multiple: int = 1
    min_inference_steps: int = 1
    max_grid: int | None = None
    max_grid_source: str = ""
    temporal_patch_size: int = 1
    min_input_images: int = 0
    max_input_images: int = 0
    min_input_image_side: int = 0
    max_input_image_aspect_ratio: float | None = None
    max_input_image_area: int | None = None
    preferred_input_sizes: tuple[tuple[int, int], ...] = ()
    default_auto_resize: bool = True
    edit_area: int | None = None
    edit_size_image: int = 0
    encoded_image_area: int | None = None
    prompt_reads_images: bool = False
    first_frame: bool = False
    components: tuple[str, ...] = ()
    takes_max_sequence_length: bool = True
    pipeline_size_multiple: int = 1
    audio_features: int = 0
    audio_latents_per_second: float = 0.0
    frame_rate: float = 0.0
    audio_sample_rate: int = 0
    first_frame_sizes: tuple[tuple[int, int], ...] = ()
    min_guidance_scale: float | None = None
    given_latent_frames: int = 0

    def check_component(self, component: str) -> None:
        """Raise ValueError unless `component` names one of the model's components: what the
        engine and its client check before a weight update or checksum sends anything."""
        if component not in self.components:
            raise ValueError(
                f"unknown component {component!r}; this model has {sorted(self.components)} "
                "(component= of update_weights and weights_checksum takes one of them)"
            )

    @property
    def is_video(self) -> bool:
        return self.default_num_frames is not None

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this many pixels."""
        return math.lcm(self.vae_scale_factor * self.patch_size * self.latent_packing, self.pipeline_size_multiple)

    @property
    def has_audio(self) -> bool:
        return self.audio_features > 0

    def audio_latent_frames(self, num_frames: int) -> int:
        """A video's latent audio frames, as LTX2Pipeline counts them (Python's rounding)."""
        return round(num_frames / self.frame_rate * self.audio_latents_per_second)

    @property
    def max_num_frames(self) -> int | None:
        """The most frames a video's latent grid allows (None: no limit, or an image model)."""
        if self.max_grid is None or not self.is_video:
            return None
        return (self.max_grid * self.temporal_patch_size - 1) * self.frame_multiple + 1

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """The shape of one sample's latents, in the form the pipeline takes as `latents=`:
        [C, F', h, w] for video (F' = (num_frames - 1) / frame_multiple + 1 latent frames); for a
        video with sound, one flat vector (`audio_features`). Latent frames a first frame supplies
        (`given_latent_frames`) are not in them."""
        h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
        if self.has_audio:  # the video's packed tokens, then the audio's packed frames, flat
            frames = (num_frames - 1) // self.frame_multiple + 1 - self.given_latent_frames
            return (
                self.latent_channels * frames * h * w + self.audio_latent_frames(num_frames) * self.audio_features,
            )
        if self.is_video:
            frames = (num_frames - 1) // self.frame_multiple + 1 - self.given_latent_frames
            return (self.latent_channels, frames, h, w)
        p = self.latent_packing
        if p == 1:
            return (self.latent_channels, h, w)
        return ((h // p) * (w // p), self.latent_channels * p * p)

    def auto_resizes(self, params: SamplingParams) -> bool:
        """Whether the input images of a request with `params` are resized to `preferred_input_sizes`
        (`auto_resize`; `default_auto_resize` where the request leaves it unset), where the family has
        such sizes."""
        auto_resize = self.default_auto_resize if params.auto_resize is None else params.auto_resize
        return bool(self.preferred_input_sizes) and auto_resize

    def edit_size(self, sizes: tuple[tuple[int, int], ...], auto_resize: bool = False) -> tuple[int, int]:
        """The output size of an edit whose request sets none, from its input images' (height,
        width) sizes: the size of image `edit_size_image`, after the resize the pipeline makes (to
        the nearest of `preferred_input_sizes` with `auto_resize`, to `edit_area` pixels at its
        aspect ratio, or down to `max_input_image_area`), rounded down to the size multiple (as edit
        pipelines round the image they encode)."""
        if self.first_frame and self.first_frame_sizes:
            return self.first_frame_size(*sizes[0])
        if self.first_frame:  # the pipeline's default size (Wan's, LTX-2's I2V), whatever the image's
            return self.default_height, self.default_width
        image_height, image_width = sizes[self.edit_size_image]
        multiple = self.size_multiple
        if auto_resize and self.preferred_input_sizes:
            image_height, image_width = self._preferred_size(image_height, image_width)
        if self.edit_area is not None:
            image_height, image_width = area_size(self.edit_area, image_height, image_width)
        area = self.max_input_image_area
        if area is not None and image_height * image_width > area:
            # Flux2ImageProcessor._resize_to_target_area's arithmetic (the encoder calls it).
            scale = math.sqrt(area / (image_width * image_height))
            image_height, image_width = int(image_height * scale), int(image_width * scale)
        return max(multiple, image_height // multiple * multiple), max(multiple, image_width // multiple * multiple)

    def first_frame_size(self, height: int, width: int) -> tuple[int, int]:
        """The video's (height, width) for a first frame of `height` x `width` pixels: the size of
        `first_frame_sizes` nearest its aspect ratio, never wider in aspect than the frame (on the
        frame's side of square), the first of equals."""
        # Copied from diffusers.pipelines.hunyuan_video1_5.image_processor.get_closest_ratio (its
        # ratios rounded to 5 places, as calculate_default_height_width rounds them); kept here so
        # admission needs no diffusers.
        aspect = float(height) / float(width)
        ratios = [round(float(h) / float(w), 5) for h, w in self.first_frame_sizes]
        differences = [(i, r - aspect) for i, r in enumerate(ratios)]
        candidates = [(i, d) for i, d in differences if (d <= 0 if aspect >= 1 else d >= 0)]
        index = min(candidates, key=lambda pair: abs(pair[1]))[0]
        return tuple(self.first_frame_sizes[index])

    def first_frame_size_problems(self, sizes: tuple[tuple[int, int], ...], params: SamplingParams) -> list[str]:
        """A request whose size is not the one its first frame picks (`first_frame_sizes`)."""
        if not self.first_frame_sizes or not sizes or params.height is None or params.width is None:
            return []
        height, width = self.first_frame_size(*sizes[0])
        if (params.height, params.width) == (height, width):
            return []
        return [
            f"height={params.height}, width={params.width} is not the size {self.pipeline_class} makes from this "
            f"{sizes[0][0]}x{sizes[0][1]} first frame: it takes no size and makes the video at the one of its sizes "
            f"nearest the frame's aspect ratio, {height}x{width}; leave height and width unset (or set them to that)"
        ]

    def image_encoding(self, params: SamplingParams) -> dict:
        """The settings of a (resolved) request that its input images' encoding depends on
        (`InputImages.encoded_with`): FLUX.1 Kontext's `auto_resize`; a first frame's output size and
        frame count (the pipeline resizes it to the video's size and encodes it with the frames after
        it). Empty where the encoding is the images' alone."""
        settings = {"auto_resize": params.auto_resize} if self.preferred_input_sizes else {}
        if self.first_frame:
            settings |= {"height": params.height, "width": params.width, "num_frames": params.num_frames}
        return settings

    def encoded_image_sizes(self, sizes: tuple[tuple[int, int], ...], auto_resize: bool = False) -> tuple:
        """The (height, width) each input image of these sizes is encoded at, where the family's
        resize is known here: FLUX.1 Kontext's (rounded down to the size multiple, as its image
        processor's `get_default_height_width` does, after the resize to `preferred_input_sizes`
        with `auto_resize`); Qwen-Image-Edit's (`encoded_image_area` pixels at the image's aspect
        ratio, in multiples of 32). Elsewhere, the images' own sizes. Requests whose images encode
        at equal sizes stack their encoded tokens, so this is what the scheduler batches edits by:
        raw sizes that encode alike (any two of an aspect ratio, auto-resized or resized to an
        area) share their forwards."""
        if self.encoded_image_area is not None:
            return tuple(area_size(self.encoded_image_area, height, width) for height, width in sizes)
        if not self.preferred_input_sizes:
            return sizes
        multiple = self.size_multiple
        resized = [self._preferred_size(*size) if auto_resize else size for size in sizes]
        return tuple((height // multiple * multiple, width // multiple * multiple) for height, width in resized)

    def encoded_image_pixels(self, sizes: tuple[tuple[int, int], ...], auto_resize: bool = False) -> tuple[int, ...]:
        """The pixels each input image of these (height, width) sizes is encoded at, what every
        forward pass sees of it: `encoded_image_sizes`, and at most `max_input_image_area` where
        the family resizes down to it (FLUX.2)."""
        area = self.max_input_image_area
        encoded = (height * width for height, width in self.encoded_image_sizes(sizes, auto_resize))
        return tuple(pixels if area is None else min(pixels, area) for pixels in encoded)

    def _preferred_size(self, height: int, width: int) -> tuple[int, int]:
        """FluxKontextPipeline.__call__ step 3's choice for an image of `height` x `width` (rounded
        down to the size multiple first, as its `get_default_height_width`): the preferred size of
        the nearest aspect ratio, the narrowest of equals."""
        multiple = self.size_multiple
        aspect_ratio = (width // multiple * multiple) / (height // multiple * multiple)
        _, width, height = min((abs(aspect_ratio - w / h), w, h) for h, w in self.preferred_input_sizes)
        return height, width

    def text_key(self, text: str, max_sequence_length: int, images) -> tuple:
        """What identifies an encoded text: the text and its length, and, where the prompt's encoding
        reads the images (`prompt_reads_images`), the digest of the request's `InputImages` (or None)."""
        if not self.prompt_reads_images:
            return (text, max_sequence_length)
        return (text, max_sequence_length, None if images is None else images.digest)

    def image_problems(self, sizes: tuple[tuple[int, int], ...]) -> list[str]:
        """What is wrong with a request whose input images have these (height, width) sizes
        (empty: a text-only request)."""
        model, count = self.pipeline_class, len(sizes)
        if count and not self.max_input_images:
            return [f"{model} takes no input images; pass images only to an edit family's model"]
        if count > self.max_input_images:
            return [f"{model} takes at most {self.max_input_images} input images per prompt, got {count}"]
        if count < self.min_input_images and self.first_frame:
            return [
                f"{model} makes a video from its first frame: pass images=[[image], ...], the first frame of "
                "each prompt's video (a uint8 [3, H, W] tensor or a PIL image, resized to the video's size)"
            ]
        if count < self.min_input_images:
            return [
                f"{model} edits input images: pass images=[[image], ...] with {self.min_input_images} or more "
                "images per prompt (uint8 [3, H, W] tensors or PIL images)"
            ]
        if self.first_frame:  # resized to the video's size, whatever its own
            return []
        if self.edit_area is not None:  # resized to the area first: only the aspect ratio can be wrong
            return [
                f"input image {i} is {height}x{width} pixels, too narrow for {model}, which resizes it to about "
                f"{self.edit_area} pixels at its aspect ratio in multiples of 32; pass a less elongated image"
                for i, (height, width) in enumerate(sizes)
                if min(area_size(self.edit_area, height, width)) == 0
            ]
        smallest = max(self.size_multiple, self.min_input_image_side)
        problems = [
            f"input image {i} is {height}x{width} pixels, smaller than the {smallest} pixels {model} encodes "
            f"at least on each side; pass a larger image"
            for i, (height, width) in enumerate(sizes)
            if min(height, width) < smallest
        ]
        ratio = self.max_input_image_aspect_ratio
        problems += [
            f"input image {i} is {height}x{width} pixels, longer than {ratio:g} times its other side, the most "
            f"{model} takes; crop it"
            for i, (height, width) in enumerate(sizes)
            if ratio is not None and min(height, width) and max(height, width) / min(height, width) > ratio
        ]
        return problems

    def resolve(self, params: SamplingParams) -> tuple[SamplingParams, list[str]]:
        """`params` with every model-dependent default filled in, and every problem with them.

        A resolved request has `negative_prompt` set exactly when it uses classifier-free guidance.
        """
        problems = []
        model = self.pipeline_class
        height = params.height if params.height is not None else self.default_height
        width = params.width if params.width is not None else self.default_width
        multiple = self.size_multiple
        why = f"VAE scale {self.vae_scale_factor} x patch size {self.patch_size}"
        why += f" x latent packing {self.latent_packing}" if self.latent_packing > 1 else ""
        if self.pipeline_size_multiple > 1:
            why += f", and {model}'s own rule: multiples of {self.pipeline_size_multiple}"
        for name, value in (("height", height), ("width", width)):
            if value % multiple:
                problems.append(
                    f"{name}={value} is not divisible by {multiple} ({why}); "
                    f"use e.g. {max(multiple, value // multiple * multiple)}"
                )
            elif self.max_grid is not None and value > self.max_grid * multiple:
                problems.append(
                    f"{name}={value} is above the {self.max_grid * multiple} pixels {model}'s transformer takes "
                    f"({self.max_grid_source} {self.max_grid} tokens x {why}); use at most {self.max_grid * multiple}"
                )
        if params.num_inference_steps < self.min_inference_steps:
            problems.append(
                f"num_inference_steps={params.num_inference_steps} is too few for {model}: its scheduler gives no "
                f"finite schedule for fewer than {self.min_inference_steps} steps"
            )
        num_frames = params.num_frames
        if num_frames is not None and not self.is_video:
            problems.append(f"num_frames is for video pipelines; {model} makes images, so leave num_frames unset")
        if self.is_video:
            num_frames = num_frames if num_frames is not None else self.default_num_frames
            if (num_frames - 1) % self.frame_multiple:
                nearest = max(1, round((num_frames - 1) / self.frame_multiple)) * self.frame_multiple + 1
                problems.append(
                    f"num_frames={num_frames} does not fit {model}'s VAE, which compresses time by "
                    f"{self.frame_multiple} after the first frame: use k * {self.frame_multiple} + 1 frames, "
                    f"e.g. num_frames={nearest}"
                )
            elif self.max_grid is not None and num_frames > self.max_num_frames:
                problems.append(
                    f"num_frames={num_frames} is above the {self.max_num_frames} frames {model}'s transformer takes "
                    f"({self.max_grid_source} {self.max_grid} latent frames x {self.temporal_patch_size} per token); "
                    f"use at most {self.max_num_frames}"
                )
        max_length = params.max_sequence_length or self.default_max_sequence_length
        if not self.takes_max_sequence_length and params.max_sequence_length is not None:
            problems.append(f"max_sequence_length is not used by {model}, which reads whole prompts; leave it unset")
        elif max_length > self.max_sequence_length_limit:
            problems.append(
                f"max_sequence_length={max_length} is above {model}'s limit of {self.max_sequence_length_limit}"
            )
        if params.auto_resize is not None and not self.preferred_input_sizes:
            problems.append(
                f"auto_resize is FLUX.1 Kontext's resize of its input image; {model} has none, so leave it unset"
            )
        minimum = self.min_guidance_scale
        scale = getattr(params, self.cfg_field) if self.cfg_field is not None else None
        if minimum is not None and scale is not None and scale < minimum:
            problems.append(
                f"{self.cfg_field}={scale} is below {minimum:g}: {model}'s guider would guide with it (it guides at "
                f"any scale but 1), which this engine does not run; use {minimum:g} (no guidance) or more"
            )
        guidance = {}
        for name in GUIDANCE_FIELDS:
            value = getattr(params, name)
            if name not in self.guidance_defaults:
                if value is not None:
                    problems.append(f"{name} is not used by {model}; leave it unset ({self._guidance_hint()})")
                continue
            guidance[name] = value if value is not None else self.guidance_defaults[name]
        for name, source in self.guidance_fallbacks.items():
            if guidance.get(name) is None:
                guidance[name] = guidance.get(source)
        for name, value in guidance.items():
            if value is None:
                problems.append(f"{name} is required by this {model} (a guidance-distilled model); set it")
        negative = self._negative_prompt(params, guidance, problems)
        resolved = dataclasses.replace(
            params,
            height=height,
            width=width,
            max_sequence_length=max_length,
            num_frames=num_frames,
            negative_prompt=negative,
            auto_resize=self.auto_resizes(params) if self.preferred_input_sizes else None,
            **{name: guidance.get(name) for name in GUIDANCE_FIELDS},
        )
        return resolved, problems

    def _negative_prompt(self, params: SamplingParams, guidance: dict, problems: list[str]) -> str | None:
        scale = guidance.get(self.cfg_field) if self.cfg_field is not None else None
        cfg = scale is not None and scale > self.cfg_threshold
        if not cfg:
            if params.negative_prompt is not None:
                turns_on = f"turns on with {self.cfg_field} > {self.cfg_threshold:g}" if self.cfg_field else ""
                problems.append(
                    f"negative_prompt is used only with classifier-free guidance, which {self.pipeline_class} "
                    + (turns_on or "does not have")
                    + "; leave negative_prompt unset or raise the scale"
                )
            return None
        negative = params.negative_prompt if params.negative_prompt is not None else self.default_negative_prompt
        if negative is None:
            problems.append(
                f"{self.cfg_field}={scale} turns on classifier-free guidance, which needs a negative_prompt "
                f"({self.pipeline_class} skips guidance without one); pass negative_prompt=' ' (or any text), "
                f"or set {self.cfg_field}={self.cfg_threshold:g}"
            )
        return negative

    def _guidance_hint(self) -> str:
        if not self.guidance_defaults:
            return f"{self.pipeline_class} takes no guidance settings"
        return f"{self.pipeline_class} takes " + ", ".join(sorted(self.guidance_defaults))


def area_size(area: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) of about `area` pixels at the aspect ratio of `height` x `width`, each a
    multiple of 32: the rule of Qwen-Image-Edit's `calculate_dimensions` (Python's rounding, half
    to even, as there)."""
    ratio = width / height
    new_width = math.sqrt(area * ratio)
    new_height = new_width / ratio
    return round(new_height / 32) * 32, round(new_width / 32) * 32
