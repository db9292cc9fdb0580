"""FLUX.1 (`FluxPipeline`): dev (guidance-distilled) and schnell.

Latents are packed 2x2 patches [h/2 * w/2, C*4], the form `FluxPipeline` takes as `latents=`;
conditioning is T5's token embeddings [max_sequence_length, D] plus CLIP's pooled embedding.
`guidance_scale` is FLUX.1-dev's distilled guidance, an input of the transformer (schnell has none);
`true_cfg_scale` > 1 with a `negative_prompt` is real classifier-free guidance, as in diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout.condition import PromptEmbeds
from rollout.model_spec import ModelSpec
from rollout.pipelines.adapter import PipelineAdapter, decode_scaled_latents, packed_latents_spec
from rollout.pipelines.flow_shift import resolution_shift


@dataclass
class FluxEmbeds(PromptEmbeds):
    """prompt_embeds: [L, D] T5 tokens (L = max_sequence_length); pooled_prompt_embeds: [P] CLIP's
    pooled output. The text position ids FLUX also takes are zeros, made per forward pass."""

    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor


class FluxAdapter(PipelineAdapter):
    pipeline_class = "FluxPipeline"
    # Flow-GRPO's FLUX.1-dev LoRA: attention projections and feed-forward layers of the joint blocks.
    default_lora_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )

    def __init__(self, pipeline):
        super().__init__(pipeline)
        self._image_ids: dict[tuple, torch.Tensor] = {}  # see `image_ids`

    def make_spec(self) -> ModelSpec:
        guidance = {"true_cfg_scale": 1.0}
        if self.transformer.config.guidance_embeds:
            guidance["guidance_scale"] = 3.5  # FluxPipeline's default
        return packed_latents_spec(self, guidance, max_sequence_length_limit=512)

    def encode_prompt(self, text: str, max_sequence_length: int) -> FluxEmbeds:
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=[text], prompt_2=None, device=self.device, max_sequence_length=max_sequence_length
        )
        return FluxEmbeds(embeds[0], pooled[0]).to(self.device, self.dtype)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int, sigmas) -> None:
        # Imported here, once a pipeline is loaded: the pipeline's module imports transformers' image
        # processors, slow and noisy at import (a torchvision notice), and the registry imports this file.
        from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

        # FluxPipeline.__call__ step 5, on this scheduler.
        config = scheduler.config
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if config.get("use_flow_sigmas"):
            sigmas = None
        mu = resolution_shift(config, self.spec.latent_shape(height, width)[0])
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)

    def run_transformer(self, latents, sigmas, embeds: FluxEmbeds, guidance_scale, height, width) -> torch.Tensor:
        return self._forward(latents, self.image_ids(height, width, latents), sigmas, embeds, guidance_scale)

    def image_ids(self, height: int, width: int, latents: torch.Tensor) -> torch.Tensor:
        """The position ids [N, 3] of a `height` x `width` image's packed latent tokens, made once
        per size, device and dtype: the pipeline's helper builds them on the CPU and copies them
        to the device, a copy the host waits for at every forward."""
        key = (height, width, latents.device, latents.dtype)
        if key not in self._image_ids:
            grid = self.spec.vae_scale_factor * 2
            self._image_ids[key] = self.pipeline._prepare_latent_image_ids(
                None, height // grid, width // grid, latents.device, latents.dtype
            )
        return self._image_ids[key]

    def _forward(self, hidden_states, image_ids, sigmas, embeds: FluxEmbeds, guidance_scale) -> torch.Tensor:
        """The transformer over image tokens `hidden_states` [B, N, C] at positions `image_ids` [N, 3]."""
        device, dtype = hidden_states.device, hidden_states.dtype
        text_ids = torch.zeros(embeds.prompt_embeds.shape[1], 3, device=device, dtype=dtype)
        # FluxPipeline feeds the scheduler's timestep (sigma * 1000) in the latents' dtype, over 1000.
        timestep = (sigmas * self._scheduler.config.num_train_timesteps).to(dtype) / 1000
        return self.transformer(
            hidden_states=hidden_states,
            timestep=timestep,
            guidance=guidance_scale if self.transformer.config.guidance_embeds else None,
            pooled_projections=embeds.pooled_prompt_embeds,
            encoder_hidden_states=embeds.prompt_embeds,
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        unpacked = self.pipeline._unpack_latents(latents, height, width, self.spec.vae_scale_factor)
        return decode_scaled_latents(self.pipeline.vae, unpacked)
