"""Z-Image and Z-Image-Turbo (`ZImagePipeline`).

Latents are [C, h, w], the form `ZImagePipeline` takes as `latents=`; its single-stream transformer
patchifies them itself (2x2 patches) and takes a list of [C, 1, h, w] frames. Conditioning is the
second-to-last hidden state of Qwen3 over the prompt in its chat template, only the prompt's own
tokens: a different number per prompt, so a batch pads them and masks the padding, and the
transformer gets each row's tokens unpadded, as the pipeline passes them.

What the pipeline computes, and so the engine: the transformer is fed `1 - sigma` (its time runs
from noise at 0 to the image at 1) and predicts the negated velocity; `guidance_scale` > 0 is
classifier-free guidance as `cond + guidance_scale * (cond - uncond)`, with the negative prompt ""
unless the request names one, both halves in one forward pass. The scheduler's shift is fixed (3
for Turbo, 6 for the base model; no dynamic shifting), and the default sigmas are
`linspace(1, 1/n, n)`. The pipeline's `cfg_normalization` (clamp the guided norm) and
`cfg_truncation` (drop guidance late in the schedule) are off at their defaults (False, 1.0), and
the engine computes exactly those defaults; a request cannot set them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rollout.condition import PromptEmbeds
from rollout.model_spec import ModelSpec
from rollout.pipelines.adapter import PipelineAdapter, decode_scaled_latents
from rollout.pipelines.flow_shift import resolution_shift

# ZImageTransformer2DModel pads every caption to a multiple of this many tokens (SEQ_MULTI_OF).
CAPTION_MULTIPLE = 32


@dataclass
class ZImageEmbeds(PromptEmbeds):
    """prompt_embeds: [L, D], L the prompt's own token count in the chat template; prompt_mask: [L]
    bool, all True for one prompt, False on the padding `stack` adds to a batch."""

    padded_fields: ClassVar[tuple[str, ...]] = ("prompt_embeds", "prompt_mask")

    prompt_embeds: torch.Tensor
    prompt_mask: torch.Tensor


class ZImageAdapter(PipelineAdapter):
    pipeline_class = "ZImagePipeline"
    # Flow-Factory's Z-Image LoRA (src/flow_factory/models/z_image/z_image.py, `default_target_modules`):
    # the attention projections and the SwiGLU feed-forward of every block, refiners included.
    default_lora_targets = (
        "attention.to_k",
        "attention.to_q",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
    cfg_in_one_pass = True  # ZImagePipeline runs the prompts and the negative prompts in one list

    def make_spec(self) -> ModelSpec:
        pipeline, config = self.pipeline, self.transformer.config
        # The rotary table numbers the caption (from 1) and then the image on axis 0: a caption
        # padded to CAPTION_MULTIPLE, plus the image's position after it, must fit in axes_lens[0].
        caption_limit = (config.axes_lens[0] - 2) // CAPTION_MULTIPLE * CAPTION_MULTIPLE
        return ModelSpec(
            pipeline_class=self.pipeline_class,
            latent_channels=config.in_channels,
            vae_scale_factor=pipeline.vae_scale_factor,
            patch_size=config.all_patch_size[0],
            latent_packing=1,
            default_height=1024,  # the pipeline's `height or 1024`
            default_width=1024,
            default_max_sequence_length=512,
            max_sequence_length_limit=caption_limit,
            # The pipeline's default; Z-Image-Turbo is sampled with 0 (guidance distilled into it),
            # the base model with 3-5.
            guidance_defaults={"guidance_scale": 5.0},
            cfg_field="guidance_scale",
            cfg_threshold=0.0,
            default_negative_prompt="",
            max_grid=min(config.axes_lens[1], config.axes_lens[2]),
            max_grid_source="axes_lens",
        )

    def encode_prompt(self, text: str, max_sequence_length: int) -> ZImageEmbeds:
        (embeds,), _ = self.pipeline.encode_prompt(
            prompt=[text],
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
        )
        mask = torch.ones(embeds.shape[0], dtype=torch.bool, device=self.device)
        return ZImageEmbeds(embeds, mask).to(self.device, self.dtype)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int, sigmas) -> None:
        # Imported here, once a pipeline is loaded: the pipeline's module imports transformers' image
        # processors, slow and noisy at import (a torchvision notice), and the registry imports this file.
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas, retrieve_timesteps

        # ZImagePipeline.__call__ step 5, on this scheduler (its mu acts only with dynamic shifting).
        config = scheduler.config
        latent_h, latent_w = self.spec.latent_shape(height, width)[1:]
        patch = self.spec.patch_size
        mu = resolution_shift(config, (latent_h // patch) * (latent_w // patch))
        if sigmas is None:
            sigmas = get_default_z_image_sigmas(num_steps)
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=list(sigmas), mu=mu)

    def run_transformer(self, latents, sigmas, embeds: ZImageEmbeds, guidance_scale, height, width) -> torch.Tensor:
        # The pipeline feeds (1000 - t) / 1000 for the scheduler's timestep t = sigma * 1000, in float32.
        timestep = (1000 - sigmas * self._scheduler.config.num_train_timesteps) / 1000
        # Each caption without its padding, cut at its length known on the host (`stack`): the same
        # tokens as `tokens[mask]` (one prompt's mask is all True), whose row count the host would wait for.
        captions = [tokens[:length] for tokens, length in zip(embeds.prompt_embeds, embeds.lengths, strict=True)]
        frames = list(latents.unsqueeze(2).unbind(0))  # [C, 1, h, w] each: one frame
        out = self.transformer(frames, timestep, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # ZImagePipeline's guidance (it combines before negating; negation commutes exactly).
        return cond + scale * (cond - uncond)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_scaled_latents(self.pipeline.vae, latents)
