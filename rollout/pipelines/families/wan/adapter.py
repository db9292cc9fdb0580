"""Wan 2.1 and Wan 2.2 text-to-video (`WanPipeline`).

Latents [C, F', h, w] (F' = (num_frames - 1) / s + 1 latent frames, s the VAE's temporal scale: 4
for Wan's VAE, 2 for the tiny one); conditioning: UMT5 token embeddings, zero past the prompt's
tokens, as the pipeline pads them; `guidance_scale` is classifier-free guidance (> 1 turns it on,
with the negative prompt "" unless the request names one), run as a second pass, as the pipeline runs it.

Wan 2.2's two experts: a folder with `transformer_2` and `boundary_ratio` denoises steps whose
timestep is at or above `boundary_ratio * num_train_timesteps` with `transformer` (high noise) and
the others with `transformer_2`, guided by `guidance_scale_2` (default: `guidance_scale`), as
`WanPipeline` does. Rows on the two sides of the boundary run in separate forwards of their own
expert, so a batch never mixes them.

The engine samples on the flow-matching Euler schedule with Wan's shift (the folder's `shift`, or
the `flow_shift` of a UniPC scheduler config), as the RL recipes for Wan do. `WanPipeline` takes no
`sigmas=`, so `SamplingParams.sigmas` goes to that scheduler's `set_timesteps(sigmas=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout.condition import PromptEmbeds
from rollout.device_copy import row_index
from rollout.guidance import Guidance
from rollout.model_spec import ModelSpec
from rollout.pipelines.adapter import PipelineAdapter, images_to_uint8


@dataclass
class WanEmbeds(PromptEmbeds):
    """prompt_embeds: [L, D] (L = max_sequence_length), zero past the prompt's tokens."""

    prompt_embeds: torch.Tensor


class WanAdapter(PipelineAdapter):
    pipeline_class = "WanPipeline"
    # The attention projections of the self- and cross-attention of every block (of each expert).
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    cfg_in_one_pass = False  # WanPipeline runs the unconditional pass on its own
    reads_sigma_values = True  # Wan 2.2 picks each row's expert by its sigma

    def __init__(self, pipeline):
        super().__init__(pipeline)
        ratio = pipeline.config.boundary_ratio
        num_train_timesteps = self._scheduler.config.num_train_timesteps
        self.boundary_timestep = None if ratio is None else ratio * num_train_timesteps

    @property
    def denoisers(self) -> dict[str, torch.nn.Module]:
        experts = {"transformer": self.transformer}
        if self.pipeline.transformer_2 is not None:
            experts["transformer_2"] = self.pipeline.transformer_2
        return experts

    def make_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        config = self.pipeline.scheduler.config
        shift = config.get("flow_shift", config.get("shift", 1.0))  # UniPC names Wan's shift flow_shift
        return FlowMatchEulerDiscreteScheduler.from_config(config, shift=shift)

    def make_spec(self) -> ModelSpec:
        pipeline, config = self.pipeline, self.transformer.config
        two_experts = self.pipeline.transformer_2 is not None and pipeline.config.boundary_ratio is not None
        guidance = {"guidance_scale": 5.0} | ({"guidance_scale_2": None} if two_experts else {})
        return ModelSpec(
            pipeline_class=self.pipeline_class,
            latent_channels=config.in_channels,
            vae_scale_factor=pipeline.vae_scale_factor_spatial,
            patch_size=config.patch_size[1],
            latent_packing=1,
            # WanPipeline's defaults: 480x832, 81 frames, 512 text tokens, guidance 5.
            default_height=480,
            default_width=832,
            default_max_sequence_length=512,
            max_sequence_length_limit=512,
            guidance_defaults=guidance,
            guidance_fallbacks={"guidance_scale_2": "guidance_scale"} if two_experts else {},
            cfg_field="guidance_scale",
            default_negative_prompt="",
            default_num_frames=81,
            frame_multiple=pipeline.vae_scale_factor_temporal,
            max_grid=config.rope_max_seq_len,
            max_grid_source="rope_max_seq_len",
            temporal_patch_size=config.patch_size[0],
        )

    def encode_prompt(self, text: str, max_sequence_length: int) -> WanEmbeds:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=[text],
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
            device=self.device,
        )
        return WanEmbeds(embeds[0]).to(self.device, self.dtype)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int, sigmas) -> None:
        # WanPipeline.__call__ step 4 (it takes no sigmas; a trainer's go to the scheduler).
        if sigmas is None:
            scheduler.set_timesteps(num_steps, device="cpu")
        else:
            scheduler.set_timesteps(sigmas=list(sigmas), device="cpu")

    def run_transformer(
        self, latents, sigmas, embeds: WanEmbeds, guidance_scale, height, width, sigma_values=None, **inputs
    ):
        # WanPipeline feeds the scheduler's timestep (sigma * 1000) in float32. `inputs`: what a
        # subclass's `expert_inputs` reads (the image-to-video adapter's first frame, `images=`).
        timestep = sigmas * self._scheduler.config.num_train_timesteps
        out = None
        for expert, rows in self._rows_by_expert(timestep, sigma_values):
            step = timestep[rows]
            if self.pipeline.config.expand_timesteps:  # Wan 2.2 TI2V: one timestep per latent token
                _, _, frames, h, w = latents.shape
                patch = expert.config.patch_size
                tokens = (frames // patch[0]) * (h // patch[1]) * (w // patch[2])
                step = step[:, None].expand(-1, tokens)
            prediction = expert(
                timestep=step,
                encoder_hidden_states=embeds.prompt_embeds[rows],
                return_dict=False,
                **self.expert_inputs(latents, rows, **inputs),
            )[0]
            if out is None:
                out = prediction.new_empty(latents.shape)
            out[rows] = prediction
        return out

    def expert_inputs(self, latents: torch.Tensor, rows: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        """The transformer's inputs beside the timestep and the text for these rows: the latents
        (the image-to-video adapter adds its first frame)."""
        return {"hidden_states": latents[rows]}

    def cfg_scale(self, guidance: Guidance, sigmas: torch.Tensor) -> torch.Tensor:
        if self.boundary_timestep is None:
            return guidance.guidance_scale
        high_noise = sigmas * self._scheduler.config.num_train_timesteps >= self.boundary_timestep
        return torch.where(high_noise, guidance.guidance_scale, guidance.guidance_scale_2)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.device, vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]  # [B, 3, F, H, W]
        return images_to_uint8(video.transpose(1, 2))  # [B, F, 3, H, W]

    def _rows_by_expert(
        self, timestep: torch.Tensor, sigma_values: list[float] | None
    ) -> list[tuple[torch.nn.Module, torch.Tensor | slice]]:
        """(expert, its rows): every row to `transformer` without a boundary, else split by it:
        on the host where the rows' sigmas are given as floats (the engine's step), else on the device."""
        if self.boundary_timestep is None:
            return [(self.transformer, slice(None))]
        if sigma_values is not None:
            # The device's test in float32 arithmetic (sigma * 1000 rounded to float32, compared with
            # the boundary as float32), on the host: reading the device's answer would make it wait.
            scale = np.float32(self._scheduler.config.num_train_timesteps)
            boundary = np.float32(self.boundary_timestep)
            high = [bool(np.float32(sigma) * scale >= boundary) for sigma in sigma_values]
            groups = [(self.transformer, high), (self.pipeline.transformer_2, [not h for h in high])]
            device = timestep.device
            return [
                (expert, row_index([r for r, on in enumerate(mask) if on], len(mask), device))
                for expert, mask in groups
                if any(mask)
            ]
        high_noise = timestep >= self.boundary_timestep
        groups = [(self.transformer, high_noise), (self.pipeline.transformer_2, ~high_noise)]
        return [(expert, mask.nonzero(as_tuple=True)[0]) for expert, mask in groups if mask.any()]
