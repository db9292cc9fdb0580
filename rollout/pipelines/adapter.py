"""The contract every model family fills in one file: a `PipelineAdapter` subclass.

The engine (sampling) and the trainer (re-scoring) reach a model only through the public methods
here, so nothing outside `rollout/pipelines/` names a family, and a trajectory is always re-scored
with exactly the computation that sampled it. A family supplies hooks, never a denoising loop:

    make_spec()                          its ModelSpec (sizes, latent layout, guidance fields, defaults)
    encode_prompt(text, max_length)      one text -> its own PromptEmbeds type, on the model's device
    set_timesteps(scheduler, n, h, w, sigmas)  the schedule exactly as its diffusers pipeline sets it
    run_transformer(...)                 one forward pass over a batch of rows
    combine_cfg(cond, uncond, scale)     how guidance combines the two predictions (linear by default)
    decode(latents, height, width)       uint8 images
    default_lora_targets                 module names a LoRA targets when the user names none
    encode_images(images)                edit families only: input images as the pipeline encodes its
                                         `image=` (then `run_transformer` takes them as `images=`)

An edit family sets `ModelSpec.max_input_images`. A family whose text encoder reads the images with
the prompt (Qwen-Image-Edit's vision tokens) sets `ModelSpec.prompt_reads_images` and encodes its
texts in `encode_prompt_with_images(text, max_length, images)`; the runner keys its cache of
encoded texts by the images' digest too (`ModelSpec.text_key`).

Classifier-free guidance is batched here: the unconditional rows of the samples with a negative
prompt run in a second forward pass, or in the same pass as the conditional rows where the family's
pipeline does so (`cfg_in_one_pass`); `guidance_passes` runs them (in this process, or on the two
halves of a CFG-parallel replica group: `rollout.parallel.cfg`), and the family combines them.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import nn

from rollout.condition import Condition, PromptEmbeds
from rollout.device_copy import host_to_device, row_index
from rollout.guidance import Guidance, Scale, guidance_argument
from rollout.input_images import InputImages
from rollout.model_spec import ModelSpec
from rollout.pipelines.guidance_passes import GuidancePasses, guidance_passes_here
from rollout.pipelines.sampling_defaults import SamplingDefaults


@dataclasses.dataclass
class ForwardTally:
    """Rows through the transformer and seconds in its forwards since the last `take` (the worker
    takes it once per engine step for `RunnerOutput`; on a GPU the seconds are launch time, not
    device time, since nothing synchronizes)."""

    rows: int = 0
    seconds: float = 0.0

    def add(self, rows: int, seconds: float) -> None:
        self.rows += rows
        self.seconds += seconds

    def take(self) -> tuple[int, float]:
        taken = self.rows, self.seconds
        self.rows, self.seconds = 0, 0.0
        return taken


class PipelineAdapter(ABC):
    """Wraps a loaded diffusers pipeline of one family. Latents in and velocities out are float32."""

    pipeline_class: ClassVar[str]  # `_class_name` in model_index.json, and the diffusers class loaded
    default_lora_targets: ClassVar[tuple[str, ...]]
    # Whether the unconditional rows of CFG share the conditional rows' forward pass (SD3's pipeline
    # concatenates them) or get their own (FLUX.1's and Qwen-Image's do): the same computation as the
    # family's pipeline. On a CPU, two passes of 16 rows took 15-20% less time than one of 32 for
    # FLUX.1 (attention over 768 tokens), and they spare Qwen-Image padding the prompts to the
    # negative prompt's length.
    cfg_in_one_pass: ClassVar[bool] = False
    # Whether the schedule depends on a video's frame count (LTX-2 shifts it by the video's token
    # count): `set_timesteps` then takes `num_frames`.
    schedule_reads_frames: ClassVar[bool] = False
    # Whether `decode` needs each sample's encoded input images (`images=`, stacked): LTX-2
    # image-to-video's latents leave out the first frame, which the condition holds.
    decode_reads_images: ClassVar[bool] = False
    # Whether `run_transformer` takes its rows' sigmas as Python floats too (`sigma_values=`, None when
    # the caller gave only a tensor): Wan 2.2 picks an expert per row by noise level, and deciding
    # on the host's values spares the host waiting for the device to read the tensor.
    reads_sigma_values: ClassVar[bool] = False

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self.transformer = pipeline.transformer
        # A private scheduler: set_timesteps mutates it, and the pipeline's own must stay untouched.
        self._scheduler = self.make_scheduler()
        self._schedules: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.spec = self.make_spec()
        self.spec = dataclasses.replace(
            self.spec, min_inference_steps=self._min_inference_steps(), components=tuple(sorted(self.components))
        )
        self.forwards = ForwardTally()
        # Where the passes of a batch run: here, or split over a replica group's halves (a
        # CFG-parallel worker installs `rollout.parallel.cfg.CfgParallelPasses`).
        self.guidance_passes: GuidancePasses = guidance_passes_here

    @classmethod
    def load(cls, path: str | Path, index: dict, device: str = "cpu", dtype: torch.dtype = torch.float32):
        """Load the folder with the family's diffusers class (`from_pretrained`, local files only);
        the spec's defaults are the folder's own where it names them (`SamplingDefaults`)."""
        import diffusers

        # Components saved as [null, null] (SD3 without T5) must be passed explicitly as None.
        absent = {name: None for name, value in index.items() if isinstance(value, list) and value[0] is None}
        pipeline_cls = getattr(diffusers, cls.pipeline_class)
        pipeline = pipeline_cls.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, **absent, **cls.given_components(Path(path))
        )
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for module in pipeline.components.values():
            # Frozen from the start: nothing here takes a weight gradient (a trainer turns on what it
            # trains, as LoraPolicy does its adapter), and torch's matmul picks its kernel by the weights'
            # requires_grad even under no_grad: a strided input (SD3's text half of the joint
            # attention) is folded into one mm for a weight that requires grad and run as a bmm for
            # one that does not, 6e-8 apart on two threads. PEFT freezes the base layers it wraps,
            # so a model loaded with grads computed another base after its first adapter than before.
            if isinstance(module, nn.Module):
                module.requires_grad_(False)
        adapter = cls(pipeline)
        adapter.spec = SamplingDefaults.read(path).apply(adapter.spec, path)
        return adapter

    @classmethod
    def given_components(cls, path: Path) -> dict[str, Any]:
        """Components of the folder at `path` that the family loads itself and passes to the
        pipeline's `from_pretrained` (and so must a caller that loads the pipeline with diffusers);
        most families: none."""
        return {}

    @classmethod
    def pipeline_arguments(cls, pipeline, fields: dict[str, Any]) -> dict[str, Any]:
        """The family's diffusers pipeline's call arguments for these `SamplingParams`-named fields
        (guidance, size), for a caller that runs the pipeline itself (the tests and benchmarks):
        most pipelines take them by the same names. One that holds a setting in a component (the
        guider of HunyuanVideo 1.5) has it set there, on `pipeline`."""
        return dict(fields)

    # Hooks a family implements.

    @abstractmethod
    def make_spec(self) -> ModelSpec: ...

    @abstractmethod
    def encode_prompt(self, text: str, max_sequence_length: int) -> PromptEmbeds:
        """One text's embeddings (unbatched), on the model's device and dtype. Texts are encoded one
        at a time, so a sample's conditioning never depends on what else was encoded with it."""

    @abstractmethod
    def set_timesteps(
        self,
        scheduler: FlowMatchEulerDiscreteScheduler,
        num_steps: int,
        height: int,
        width: int,
        sigmas: Sequence[float] | None,
    ):
        """Call `scheduler.set_timesteps` with the arguments the family's pipeline passes, given the
        pipeline's `sigmas=` argument (None: the pipeline's own choice)."""

    @abstractmethod
    def run_transformer(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: PromptEmbeds,
        guidance_scale: torch.Tensor | None,
        height: int,
        width: int,
    ) -> torch.Tensor:
        """The transformer's prediction for a batch of rows of one image size: latents in the
        model's dtype and device, sigmas [rows] float32, embeds batched on the model's device and
        dtype, and each row's `guidance_scale` (None when the model does not use it; a
        guidance-distilled model takes it as an input, SD3 uses it for CFG only and ignores it)."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Images [B, 3, H, W] (videos [B, F, 3, H, W]) uint8 on CPU from latents [B, *latent_shape],
        decoded under `torch.no_grad()` as the family's pipeline decodes (with autograd on, a VAE keeps
        every activation: a video's cost tens of GiB). A family with `decode_reads_images` also
        takes the samples' encoded input images, batched, as `images=`."""

    def decode_audio(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor | None:
        """The sound of a model that makes it with its video (`spec.has_audio`: LTX-2): waveforms
        [B, channels, samples] float32 on CPU at `spec.audio_sample_rate`, from latents [B,
        *latent_shape]; None for every other model."""
        return None

    def encode_images(self, images: InputImages) -> PromptEmbeds:
        """One request's input images, encoded as the family's edit pipeline encodes its `image=`
        (unbatched, on the model's device and dtype). Only edit families (`spec.max_input_images`
        > 0) implement it; the engine refuses images for the others before they reach a worker."""
        raise NotImplementedError(f"{type(self).__name__} ({self.pipeline_class}) takes no input images")

    def encode_prompt_with_images(self, text: str, max_sequence_length: int, images: InputImages) -> PromptEmbeds:
        """One text's embeddings read together with a request's input images, as the family's edit
        pipeline encodes its prompt with `image=` (Qwen-Image-Edit's vision tokens). Only families
        whose spec sets `prompt_reads_images` implement it."""
        raise NotImplementedError(f"{type(self).__name__} ({self.pipeline_class}) encodes prompts without images")

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance of the rows that use it, in float32; `scale` broadcasts."""
        return uncond + scale * (cond - uncond)

    def cfg_scale(self, guidance: Guidance, sigmas: torch.Tensor) -> torch.Tensor:
        """Each row's classifier-free guidance scale [B], from the guidance fields' values per row
        ([B] tensors; Wan 2.2 takes another field for the rows its low-noise expert runs)."""
        return getattr(guidance, self.spec.cfg_field)

    def make_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        """The flow-matching Euler scheduler whose schedule the engine follows, from the pipeline's."""
        return FlowMatchEulerDiscreteScheduler.from_config(self.pipeline.scheduler.config)

    # What the engine and the trainer call.

    @property
    def components(self) -> dict[str, nn.Module]:
        """The modules whose weights the hot-swap API can update, by diffusers component name."""
        return {name: module for name, module in self.pipeline.components.items() if isinstance(module, nn.Module)}

    @property
    def denoisers(self) -> dict[str, nn.Module]:
        """The modules that predict velocities, by component name (what LoRA adapters attach to);
        the first is `transformer`."""
        return {"transformer": self.transformer}

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def schedule(
        self,
        num_steps: int,
        height: int,
        width: int,
        sigmas: Sequence[float] | None = None,
        num_frames: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps [T], sigmas [T+1]) float32 on CPU, exactly as the family's pipeline computes
        them (with `sigmas=` when given; for a video, of `num_frames` frames, which only a family
        with `schedule_reads_frames` reads)."""
        frames = {"num_frames": num_frames} if self.schedule_reads_frames else {}
        key = (num_steps, height, width, None if sigmas is None else tuple(sigmas), frames.get("num_frames"))
        if key not in self._schedules:
            self.set_timesteps(self._scheduler, num_steps, height, width, sigmas, **frames)
            timesteps, sigmas = self._scheduler.timesteps, self._scheduler.sigmas
            self._schedules[key] = (timesteps.to("cpu", torch.float32), sigmas.to("cpu", torch.float32))
        return self._schedules[key]

    def _min_inference_steps(self) -> int:
        """2 where one step gives a non-finite schedule (a terminal-sigma stretch divides by zero)."""
        with warnings.catch_warnings():  # numpy warns about the division it is asked to make
            warnings.simplefilter("ignore", RuntimeWarning)
            spec = self.spec
            _, sigmas = self.schedule(1, spec.default_height, spec.default_width, num_frames=spec.default_num_frames)
        return 1 if bool(torch.isfinite(sigmas).all()) else 2

    @torch.no_grad()
    def encode_prompts(
        self, texts: Sequence[str], max_sequence_length: int, images: InputImages | None = None
    ) -> list[PromptEmbeds]:
        """Each text's embeddings (`encode_prompt`); where the family's prompt encoding reads the
        request's input images (`spec.prompt_reads_images`), with `images` (`encode_prompt_with_images`)."""
        if self.spec.prompt_reads_images and images is not None:
            return [self.encode_prompt_with_images(text, max_sequence_length, images) for text in texts]
        return [self.encode_prompt(text, max_sequence_length) for text in texts]

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor | Sequence[float],
        conditions: Sequence[Condition],
        *,
        height: int,
        width: int,
        guidance: Guidance | None = None,
        guidance_scale: Scale = None,
        guidance_scale_2: Scale = None,
        true_cfg_scale: Scale = None,
    ) -> torch.Tensor:
        """Velocity [B, *latent_shape] float32.

        latents: [B, *latent_shape] of images of `height` x `width` pixels; sigmas: [B] noise
        levels, a tensor or Python floats (the engine's: a family that picks a model by noise level
        then decides without reading the device); conditions: one per sample (those with a
        negative prompt use classifier-free guidance); guidance: its fields scalars or [B], as the
        trajectory recorded them (None where the model does not use them), or the same as separate
        `guidance_scale`, `guidance_scale_2`, `true_cfg_scale`. Runs with autograd enabled when the caller has it
        enabled (the trainer does). Conditions whose input images differ in shape (or that mix
        edits and text-only requests) run in separate forwards, one per kind.
        """
        guidance = guidance_argument(
            guidance, guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, true_cfg_scale=true_cfg_scale
        )
        sigma_values = None
        if not isinstance(sigmas, torch.Tensor):
            sigma_values = [float(sigma) for sigma in sigmas]
            sigmas = host_to_device(sigma_values, self.device, torch.float32)
        kinds: dict[tuple | None, list[int]] = {}
        for row, condition in enumerate(conditions):
            kinds.setdefault(_images_shape(condition.images), []).append(row)
        if len(kinds) == 1:
            return self._predict_velocity(latents, sigmas, sigma_values, conditions, guidance, height, width)
        velocity = None
        for rows in kinds.values():
            index = row_index(rows, latents.shape[0], latents.device)
            part = self._predict_velocity(
                latents[index],
                sigmas[row_index(rows, latents.shape[0], sigmas.device)],
                None if sigma_values is None else [sigma_values[r] for r in rows],
                [conditions[r] for r in rows],
                guidance.rows(rows),
                height,
                width,
            )
            if velocity is None:
                velocity = part.new_zeros((latents.shape[0], *part.shape[1:]))
            velocity = velocity.index_put((row_index(rows, latents.shape[0], part.device),), part)
        return velocity

    def _predict_velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        sigma_values: list[float] | None,
        conditions: Sequence[Condition],
        guidance: Guidance,
        height: int,
        width: int,
    ) -> torch.Tensor:
        """`predict_velocity` of rows whose input images (if any) have one shape."""
        batch = latents.shape[0]
        device, dtype = self.device, self.dtype
        # The guided rows, from the conditions on the host: selecting them never asks the device.
        cfg_rows = [row for row, c in enumerate(conditions) if c.negative is not None]
        prompts = [c.prompt for c in conditions]
        negatives = [conditions[row].negative for row in cfg_rows]
        guidance = guidance.expand(batch, device)
        distilled = guidance.guidance_scale  # a transformer input where the model takes one
        latents = latents.to(device, dtype)
        sigmas = sigmas.to(device, torch.float32)

        images = [c.images for c in conditions]
        takes_images = self.spec.max_input_images > 0

        def run(rows: Sequence[int], embeds: list[PromptEmbeds]) -> torch.Tensor:
            index = row_index(rows, batch, device)
            batched = type(embeds[0]).stack(embeds).to(device, dtype)
            rows_guidance = distilled[index] if distilled is not None else None
            extra = {}
            if takes_images:  # the unconditional rows of CFG see the same images as the conditional
                chosen = [images[i] for i in rows]
                extra["images"] = None if chosen[0] is None else type(chosen[0]).stack(chosen).to(device, dtype)
            if self.reads_sigma_values:
                extra["sigma_values"] = None if sigma_values is None else [sigma_values[i] for i in rows]
            start = time.perf_counter()
            out = self.run_transformer(latents[index], sigmas[index], batched, rows_guidance, height, width, **extra)
            self.forwards.add(out.shape[0], time.perf_counter() - start)
            return out

        velocity, uncond = self.guidance_passes(run, latents, cfg_rows, prompts, negatives, self.cfg_in_one_pass)
        if uncond is None:
            return velocity
        index = row_index(cfg_rows, batch, device)
        scale = self.cfg_scale(guidance, sigmas)[index].view(-1, *([1] * (velocity.ndim - 1)))
        guided = self.combine_cfg(velocity[index], uncond, scale)
        if isinstance(index, slice):  # every row guided
            return guided
        return velocity.index_put((index,), guided)


def packed_latents_spec(adapter: PipelineAdapter, guidance: dict, max_sequence_length_limit: int) -> ModelSpec:
    """The spec of a pipeline that packs 2x2 latent patches into one token each, as `FluxPipeline`
    does and `QwenImagePipeline` after it: its default size, 512 prompt tokens by default, and
    `true_cfg_scale` as its classifier-free guidance."""
    pipeline = adapter.pipeline
    return ModelSpec(
        pipeline_class=adapter.pipeline_class,
        latent_channels=adapter.transformer.config.in_channels // 4,
        vae_scale_factor=pipeline.vae_scale_factor,
        patch_size=1,  # the transformer sees packed 2x2 patches one token each
        latent_packing=2,
        default_height=pipeline.default_sample_size * pipeline.vae_scale_factor,
        default_width=pipeline.default_sample_size * pipeline.vae_scale_factor,
        default_max_sequence_length=512,
        max_sequence_length_limit=max_sequence_length_limit,
        guidance_defaults=guidance,
        cfg_field="true_cfg_scale",
    )


def _images_shape(images: PromptEmbeds | None) -> tuple | None:
    """What must agree for conditions' encoded images to stack: each field's shape."""
    return None if images is None else tuple((name, tuple(t.shape)) for name, t in images.tensors().items())


def images_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """A VAE's [-1, 1] images as uint8 on CPU, rounded as diffusers' image processor rounds, laid
    out contiguously whatever the VAE's memory format (a channels-last or transposed batch would
    otherwise give each image of it a copy of its own on its way out of a worker process)."""
    images = (images.float() / 2 + 0.5).clamp(0, 1)
    return (images * 255).round().to(torch.uint8, memory_format=torch.contiguous_format).cpu()


def decode_scaled_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """uint8 images from latents in the transformer's space: un-scaled by the VAE's scaling and shift
    factors (as SD3's, FLUX.1's and Z-Image's pipelines do before `vae.decode`), then decoded."""
    scaled = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    return images_to_uint8(vae.decode(scaled, return_dict=False)[0])
