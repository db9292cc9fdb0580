"""The model families the tests run on: every descriptor in `rollout.pipelines.families`, with the
sizes of its tiny pipeline's requests. How a family's requests turn classifier-free guidance on and
off is the descriptor's (`Family.cfg_on` / `cfg_off`), so tests and benchmarks guide alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rollout import SamplingParams
from rollout.pipelines import family as family_module
from rollout.pipelines.families import FAMILIES as DESCRIPTORS

TINY_SIZE = {"height": 32, "width": 32}  # every tiny pipeline's images (and video frames)
TINY_NUM_FRAMES = 9  # a tiny video: 5 latent frames (the tiny VAE halves time after the first frame)
# An edit family's tiny input images: a square one, and one of another shape (batched apart).
# Flux2KleinPipeline and Flux2Pipeline refuse images under 64 pixels on a side
# (Flux2ImageProcessor.check_image_input).
EDIT_SIZES = {"flux2_klein": [(64, 64), (64, 96)], "flux2_dev": [(64, 64), (64, 96)]}
DEFAULT_EDIT_SIZES = [(32, 32), (24, 40)]


@dataclass(frozen=True)
class Family(family_module.Family):
    """A family's descriptor, with what the tests ask of its tiny pipeline: requests of its sizes
    with guidance on or off, its input images, and its own diffusers pipeline."""

    @classmethod
    def of(cls, descriptor: family_module.Family) -> Family:
        return cls(**{field.name: getattr(descriptor, field.name) for field in dataclasses.fields(descriptor)})

    @property
    def cfg(self) -> dict:
        """SamplingParams fields that turn CFG on."""
        return self.guidance_fields(cfg=True)

    @property
    def no_cfg(self) -> dict:
        """... and off."""
        return self.guidance_fields(cfg=False)

    @property
    def extra(self) -> dict:
        """SamplingParams fields every request sets: frames of a video; FLUX.1 Kontext's edits encode
        their tiny images at their own size (its pipeline's default resize to about a megapixel
        would make each forward attend over ~66k image tokens)."""
        if self.video:
            return {"num_frames": TINY_NUM_FRAMES}
        return {"auto_resize": False} if self.name == "flux_kontext" else {}

    def diffusers_pipeline(self, path: str | Path):
        """The family's own diffusers pipeline, loaded from the folder at `path` as the engine loads
        it: with the components the family makes itself (`PipelineAdapter.given_components`; the
        Qwen-Image edit pipelines' processor, which without torchvision is a `Qwen2VLProcessor`
        subclass with no video processor). The pipeline class and every other component are
        diffusers' and transformers' own."""
        import diffusers

        if self.pipeline_class == "WanImageToVideoPipeline":  # its text cleaning calls ftfy unconditionally
            pytest.importorskip("ftfy", reason="WanImageToVideoPipeline.__call__ needs ftfy")
        pipeline_class = getattr(diffusers, self.pipeline_class)
        pipeline = pipeline_class.from_pretrained(path, **self.adapter.given_components(Path(path)))
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    @property
    def pipeline_extra(self) -> dict:
        """Arguments of the family's diffusers pipeline that its requests' behaviour needs beside the
        guidance fields: LTX2Pipeline's other guidance terms off (its defaults add STG, modality
        isolation and a rescale, which the engine does not run) and its audio scale taken from
        guidance_scale; LTX2ImageToVideoPipeline's as well, and its first frame encoded as given
        (`image_crf=0`: no H.264 re-compression)."""
        if self.pipeline_class == "LTX2ImageToVideoPipeline":
            from rollout.pipelines.families.ltx2.i2v import PIPELINE_SETTINGS

            return dict(PIPELINE_SETTINGS)
        if self.pipeline_class != "LTX2Pipeline":
            return {}
        from rollout.pipelines.families.ltx2.adapter import PIPELINE_GUIDANCE_OFF

        return dict(PIPELINE_GUIDANCE_OFF)

    def params(self, cfg: bool = False, **kwargs) -> SamplingParams:
        """Sampling params for this family's tiny model: 32x32 images (or 9-frame videos), CFG on or off."""
        fields = {**TINY_SIZE, **self.extra, **(self.cfg if cfg else self.no_cfg), **kwargs}
        return SamplingParams(**fields)

    @property
    def edit_sizes(self) -> list[tuple[int, int]]:
        """(height, width) of an edit family's tiny input images: a square and another shape."""
        return EDIT_SIZES.get(self.name, DEFAULT_EDIT_SIZES)

    def inputs(self, num_prompts: int = 1, sizes: list[tuple[int, int]] | None = None) -> dict:
        """`generate`'s keyword arguments beside prompts and params: for an edit family, one tiny
        input image per prompt (`input_image(i)`, of the family's square edit size unless `sizes`
        says), else nothing."""
        if not self.edits:
            return {}
        sizes = sizes or [self.edit_sizes[0]] * num_prompts
        return {"images": [[input_image(i, *size)] for i, size in enumerate(sizes)]}

    def pipeline_inputs(self, images: dict | None = None, height: int = 32, width: int = 32, prompt: int = 0) -> dict:
        """The edit pipeline's arguments beside the prompt for an output of `height` x `width`
        and prompt `prompt`'s images of `inputs()`; nothing for a text-to-image family.
        FluxKontextPipeline: `max_area` keeps it from rescaling the output to a megapixel, and
        `_auto_resize=False` encodes the image at its own size, as the tiny requests ask. FLUX.2
        [klein] and the Qwen-Image edit pipelines take the image (Plus, FLUX.2: the list of images)
        as they are."""
        if not self.edits:
            return {}
        from rollout.input_images import InputImages

        pil = InputImages.of(images["images"][prompt]).pil() if images else None
        if self.pipeline_class == "FluxKontextPipeline":
            call = {"max_area": height * width}
            return call | ({"image": pil[0], "_auto_resize": False} if pil else {})
        if pil is None:
            return {}
        takes_a_list = self.pipeline_class in ("QwenImageEditPlusPipeline", "Flux2KleinPipeline", "Flux2Pipeline")
        return {"image": pil if takes_a_list else pil[0]}


def input_image(index: int, height: int = 32, width: int = 32) -> torch.Tensor:
    """A tiny edit input: uint8 [3, H, W], a coloured square on a background, both set by `index`."""
    generator = torch.Generator().manual_seed(1000 + index)
    background, square = torch.randint(0, 256, (2, 3), generator=generator, dtype=torch.uint8)
    image = background.view(3, 1, 1).expand(3, height, width).clone()
    top, left = height // 4 + index % 3, width // 4 + index % 5
    image[:, top : top + height // 2, left : left + width // 2] = square.view(3, 1, 1)
    return image


FAMILIES = {d.name: Family.of(d) for d in DESCRIPTORS if not d.video}
# Video families: their outputs are `video`, not `image`, so the image tests do not run on them.
VIDEO_FAMILIES = {d.name: Family.of(d) for d in DESCRIPTORS if d.video}
ALL_FAMILIES = FAMILIES | VIDEO_FAMILIES
# Text-to-video (WanPipeline, HunyuanVideo15Pipeline, LTX2Pipeline) and image-to-video
# (WanImageToVideoPipeline, HunyuanVideo15ImageToVideoPipeline: a first frame per request).
TEXT_TO_VIDEO_FAMILIES = {name: f for name, f in VIDEO_FAMILIES.items() if not f.edits}
IMAGE_TO_VIDEO_FAMILIES = {name: f for name, f in VIDEO_FAMILIES.items() if f.edits}
# Video with sound (LTX-2): tests/rollout/pipelines/test_ltx2.py.
AUDIO_VIDEO_FAMILIES = {name: f for name, f in VIDEO_FAMILIES.items() if f.pipeline_class.startswith("LTX2")}

# The families whose matrix tests (parity, re-scoring, batching, the tiny pipeline) run in the default
# suite; every other family's run in the slow suite (CI runs both), so that a new family does not
# push the default suite over its budget. These three cover the three latent layouts: SD3's image
# latents, FLUX.1's packed tokens, Qwen-Image's packed tokens with a text mask. (flux_kontext, the
# first edit family, runs in the slow suite; tests/rollout/test_edits.py keeps a quick edit check
# in the default one.)
DEFAULT_MATRIX = ("sd3", "flux", "qwen_image")


# Families whose every request encodes megapixel reference images (the Qwen-Image edit pipelines
# resize each input image to about a megapixel for the VAE): even the per-family checks that run in
# the default suite for other families (the tiny folder, the small preset) run in the slow one.
SLOW_FAMILIES = ("qwen_image_edit", "qwen_image_edit_plus")


def slow_family(descriptor: family_module.Family) -> list:
    """The slow mark for a family of SLOW_FAMILIES, else nothing."""
    return [pytest.mark.slow] if descriptor.name in SLOW_FAMILIES else []


def matrix(families: dict[str, Family] | None = None) -> list:
    """Pytest params over `families` (default: the image families): a family outside DEFAULT_MATRIX
    is marked slow."""
    families = FAMILIES if families is None else families
    return [
        pytest.param(name, marks=[] if name in DEFAULT_MATRIX else [pytest.mark.slow]) for name, f in families.items()
    ]
