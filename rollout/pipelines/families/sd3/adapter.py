"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`).

Latents [C, h, w]; conditioning: CLIP-L, CLIP-G and T5 token embeddings concatenated ([77 + T, D])
plus the two CLIPs' pooled embeddings; `guidance_scale` is classifier-free guidance (negative prompt
"" unless the request names one, as in diffusers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.condition import PromptEmbeds
from rollout.model_spec import ModelSpec
from rollout.pipelines.adapter import PipelineAdapter, decode_scaled_latents
from rollout.pipelines.flow_shift import resolution_shift


@dataclass
class SD3Embeds(PromptEmbeds):
    """prompt_embeds: [L, D] (L = 77 + max_sequence_length); pooled_prompt_embeds: [P]."""

    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor


class SD3Adapter(PipelineAdapter):
    pipeline_class = "StableDiffusion3Pipeline"
    # The attention projections of the joint blocks, as Flow-GRPO trains SD3.5.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    cfg_in_one_pass = True  # StableDiffusion3Pipeline concatenates the two halves

    def make_spec(self) -> ModelSpec:
        pipeline, config = self.pipeline, self.transformer.config
        return ModelSpec(
            pipeline_class=self.pipeline_class,
            latent_channels=config.in_channels,
            vae_scale_factor=pipeline.vae_scale_factor,
            patch_size=config.patch_size,
            latent_packing=1,
            default_height=pipeline.default_sample_size * pipeline.vae_scale_factor,
            default_width=pipeline.default_sample_size * pipeline.vae_scale_factor,
            default_max_sequence_length=256,
            max_sequence_length_limit=512,
            # 4.5 is what Flow-GRPO samples SD3.5 with (diffusers' own default is 7.0).
            guidance_defaults={"guidance_scale": 4.5},
            cfg_field="guidance_scale",
            default_negative_prompt="",
            max_grid=config.pos_embed_max_size,
            max_grid_source="pos_embed_max_size",
        )

    def encode_prompt(self, text: str, max_sequence_length: int) -> SD3Embeds:
        # Without a T5 encoder diffusers feeds zeros in its place, max_sequence_length of them.
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=[text],
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
        )
        return SD3Embeds(embeds[0], pooled[0]).to(self.device, self.dtype)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int, sigmas) -> None:
        config = scheduler.config
        kwargs = {}
        if config.get("use_dynamic_shifting", False):
            patch = self.spec.patch_size
            latent_h, latent_w = height // self.spec.vae_scale_factor, width // self.spec.vae_scale_factor
            kwargs["mu"] = resolution_shift(config, (latent_h // patch) * (latent_w // patch), default_max_shift=1.16)
        scheduler.set_timesteps(num_steps, device="cpu", sigmas=sigmas, **kwargs)

    def run_transformer(self, latents, sigmas, embeds: SD3Embeds, guidance_scale, height, width) -> torch.Tensor:
        return self.transformer(
            hidden_states=latents,
            timestep=sigmas * self._scheduler.config.num_train_timesteps,
            encoder_hidden_states=embeds.prompt_embeds,
            pooled_projections=embeds.pooled_prompt_embeds,
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_scaled_latents(self.pipeline.vae, latents)
