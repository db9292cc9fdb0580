"""Qwen-Image (`QwenImagePipeline`).

Latents are packed 2x2 patches [h/2 * w/2, C*4], the form `QwenImagePipeline` takes as `latents=`.
Conditioning is Qwen2.5-VL's hidden states of the prompt in Qwen-Image's chat template, a
different number of tokens per prompt: a batch pads them and masks the padding. `true_cfg_scale`
> 1 with a `negative_prompt` is classifier-free guidance, and the guided prediction is rescaled to
the conditional one's norm, as the pipeline does. (diffusers' default `true_cfg_scale` is 4.0 but
takes effect only with a negative prompt, so the default here is 1: off.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from rollout.condition import PromptEmbeds
from rollout.model_spec import ModelSpec
from rollout.pipelines.adapter import PipelineAdapter, images_to_uint8, packed_latents_spec
from rollout.pipelines.flow_shift import resolution_shift


@dataclass
class QwenImageEmbeds(PromptEmbeds):
    """prompt_embeds: [L, D], L the prompt's own token count; prompt_mask: [L] bool, all True for one
    prompt, False on the padding `stack` adds to a batch."""

    padded_fields: ClassVar[tuple[str, ...]] = ("prompt_embeds", "prompt_mask")

    prompt_embeds: torch.Tensor
    prompt_mask: torch.Tensor


class QwenImageAdapter(PipelineAdapter):
    pipeline_class = "QwenImagePipeline"
    # The attention projections of both streams (diffusers' Qwen-Image LoRA scripts use the first four).
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

    def make_spec(self) -> ModelSpec:
        guidance: dict[str, float | None] = {"true_cfg_scale": 1.0}
        if self.transformer.config.guidance_embeds:
            guidance["guidance_scale"] = None  # a guidance-distilled variant: the pipeline requires it
        return packed_latents_spec(self, guidance, max_sequence_length_limit=1024)

    def encode_prompt(self, text: str, max_sequence_length: int) -> QwenImageEmbeds:
        embeds, mask = self.pipeline.encode_prompt(
            prompt=[text], device=self.device, max_sequence_length=max_sequence_length
        )
        mask = torch.ones(embeds.shape[1], dtype=torch.bool, device=self.device) if mask is None else mask[0].bool()
        return QwenImageEmbeds(embeds[0], mask).to(self.device, self.dtype)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int, sigmas) -> None:
        # Imported here, once a pipeline is loaded: the pipeline's module imports transformers' image
        # processors, slow and noisy at import (a torchvision notice), and the registry imports this file.
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

        # QwenImagePipeline.__call__ step 4, on this scheduler.
        config = scheduler.config
        mu = resolution_shift(config, self.spec.latent_shape(height, width)[0])
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)

    def run_transformer(self, latents, sigmas, embeds: QwenImageEmbeds, guidance_scale, height, width) -> torch.Tensor:
        return self._forward(latents, sigmas, embeds, guidance_scale, [self.output_tokens(height, width)])

    def output_tokens(self, height: int, width: int) -> tuple[int, int, int]:
        """The (frames, rows, columns) token grid of an output of `height` x `width` pixels, as
        `img_shapes` lists it."""
        grid = self.spec.vae_scale_factor * 2
        return (1, height // grid, width // grid)

    def _forward(self, hidden_states, sigmas, embeds: QwenImageEmbeds, guidance_scale, img_shapes) -> torch.Tensor:
        """One transformer pass over `hidden_states` [B, N, C*4], whose tokens are the grids of
        `img_shapes` (the output's, then any reference images': the edit pipelines'), each row alike."""
        # The pipeline passes no mask when nothing is padded; the result is the same either way. One
        # prompt's mask is all True, so a batch is padded exactly when its rows' lengths differ: the
        # host knows them (`stack`), where `mask.all()` would make it wait for the device.
        padded = len(set(embeds.lengths)) > 1
        return self.transformer(
            hidden_states=hidden_states,
            timestep=(sigmas * self._scheduler.config.num_train_timesteps).to(hidden_states.dtype) / 1000,
            guidance=guidance_scale if self.transformer.config.guidance_embeds else None,
            encoder_hidden_states_mask=embeds.prompt_mask if padded else None,
            encoder_hidden_states=embeds.prompt_embeds,
            img_shapes=[list(img_shapes)] * hidden_states.shape[0],
            return_dict=False,
        )[0]

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        combined = uncond + scale * (cond - uncond)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        unpacked = self.pipeline._unpack_latents(latents, height, width, self.spec.vae_scale_factor)
        return decode_normalised(self.pipeline.vae, unpacked)


def decode_normalised(vae, unpacked: torch.Tensor) -> torch.Tensor:
    """uint8 images from a Qwen-Image VAE's latents [B, C, 1, h, w] (one frame), normalised by the
    VAE's per-channel mean and std: un-normalised and decoded as Qwen-Image's pipelines (2.1's too)
    do. The first three output channels are the image (an RGBA VAE's fourth is alpha)."""
    unpacked = unpacked.to(vae.device, vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(unpacked.device, unpacked.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(unpacked.device, unpacked.dtype)
    images = vae.decode(unpacked / inverse_std + mean, return_dict=False)[0][:, :3, 0]
    return images_to_uint8(images)
