"""Stable Diffusion 3 / 3.5 adapter: prompt encoding, batched velocity prediction, decoding.

The engine and the trainer both call `predict_velocity`, so a trajectory is always re-scored with
exactly the computation that sampled it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from rollout.pipelines.condition import Condition


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about a loaded model to validate and shape requests."""

    pipeline_class: str
    latent_channels: int
    vae_scale_factor: int
    patch_size: int
    default_height: int
    default_width: int

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this many pixels."""
        return self.vae_scale_factor * self.patch_size

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        return (self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)


class SD3Adapter:
    """Wraps a loaded `StableDiffusion3Pipeline`. Latents in and velocities out are float32."""

    pipeline_class = "StableDiffusion3Pipeline"

    def __init__(self, pipeline, max_sequence_length: int = 256):
        self.pipeline = pipeline
        self.transformer = pipeline.transformer
        # SD3's default T5 length; without a T5 encoder these are zero tokens, as in diffusers.
        self.max_sequence_length = max_sequence_length
        # A private scheduler: set_timesteps mutates it, and the pipeline's own must stay untouched.
        self._scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipeline.scheduler.config)
        self._schedules: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        vae_scale_factor = pipeline.vae_scale_factor
        sample_size = self.transformer.config.sample_size
        self.spec = ModelSpec(
            pipeline_class=self.pipeline_class,
            latent_channels=self.transformer.config.in_channels,
            vae_scale_factor=vae_scale_factor,
            patch_size=self.transformer.config.patch_size,
            default_height=sample_size * vae_scale_factor,
            default_width=sample_size * vae_scale_factor,
        )

    @property
    def components(self) -> dict[str, torch.nn.Module]:
        """The modules whose weights the hot-swap API can update, by diffusers component name."""
        pipeline = self.pipeline
        modules = {
            "transformer": pipeline.transformer,
            "vae": pipeline.vae,
            "text_encoder": pipeline.text_encoder,
            "text_encoder_2": pipeline.text_encoder_2,
            "text_encoder_3": pipeline.text_encoder_3,
        }
        return {name: module for name, module in modules.items() if module is not None}

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def schedule(self, num_steps: int, latent_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps [T], sigmas [T+1]) float32 on CPU, exactly as diffusers' pipeline computes them."""
        seq_len = (latent_hw[0] // self.spec.patch_size) * (latent_hw[1] // self.spec.patch_size)
        key = (num_steps, seq_len)
        if key not in self._schedules:
            config = self._scheduler.config
            kwargs = {}
            if config.get("use_dynamic_shifting", False):
                kwargs["mu"] = calculate_shift(
                    seq_len,
                    config.get("base_image_seq_len", 256),
                    config.get("max_image_seq_len", 4096),
                    config.get("base_shift", 0.5),
                    config.get("max_shift", 1.16),
                )
            self._scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
            self._schedules[key] = (self._scheduler.timesteps.clone(), self._scheduler.sigmas.clone())
        return self._schedules[key]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[Condition]:
        """Encode each prompt (and the empty negative prompt) once; returns per-prompt Conditions on
        the model's device and dtype."""
        embeds, negative, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=True,
            negative_prompt=[""] * len(prompts),
            max_sequence_length=self.max_sequence_length,
        )
        return [
            Condition(embeds[i], pooled[i], negative[i], negative_pooled[i]).to(self.device, self.dtype)
            for i in range(len(prompts))
        ]

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        condition: Condition,
        guidance_scale: torch.Tensor | float,
    ) -> torch.Tensor:
        """Velocity [B, C, h, w] float32 with per-sample classifier-free guidance.

        latents: [B, C, h, w]; sigmas: [B] noise levels; condition: batched (leading dim B);
        guidance_scale: scalar or [B]. Samples with guidance <= 1 skip the unconditional branch,
        as diffusers does, so a sample's result does not depend on its batch-mates.
        Runs with autograd enabled when the caller has it enabled (the trainer does).
        """
        batch = latents.shape[0]
        device, dtype = self.device, self.dtype
        scale = torch.as_tensor(guidance_scale, dtype=torch.float32, device=device).expand(batch)
        cfg = scale > 1
        model_latents = latents.to(device, dtype)
        timesteps = sigmas.to(device, torch.float32) * self._scheduler.config.num_train_timesteps
        condition = condition.to(device, dtype)
        hidden = torch.cat([model_latents, model_latents[cfg]])
        out = self.transformer(
            hidden_states=hidden,
            timestep=torch.cat([timesteps, timesteps[cfg]]),
            encoder_hidden_states=torch.cat([condition.prompt_embeds, condition.negative_prompt_embeds[cfg]]),
            pooled_projections=torch.cat(
                [condition.pooled_prompt_embeds, condition.negative_pooled_prompt_embeds[cfg]]
            ),
            return_dict=False,
        )[0].to(torch.float32)
        velocity, uncond = out[:batch], out[batch:]
        if uncond.shape[0] == 0:
            return velocity
        guided = velocity[cfg]
        guided = uncond + scale[cfg].view(-1, 1, 1, 1) * (guided - uncond)
        return velocity.index_put((cfg.nonzero(as_tuple=True)[0],), guided)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] uint8 on CPU from latents [B, C, h, w]."""
        vae = self.pipeline.vae
        scaled = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(scaled, return_dict=False)[0]
        images = (images.float() / 2 + 0.5).clamp(0, 1)
        return (images * 255).round().to(torch.uint8).cpu()
