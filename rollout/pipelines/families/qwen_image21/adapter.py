"""Qwen-Image 2.1 (`QwenImage21Pipeline`), text-to-image.

What 2.1 changes over Qwen-Image (qwen_image.py), as its pipeline computes it:
- Text: Qwen3-VL's last decoder layer before its final norm, of the prompt in 2.1's own template
  (the system turn dropped), one sequence per prompt, no `max_sequence_length` (nothing is cut).
- Latents: the VAE compresses 16x and the transformer reads them unpatched, `[H/16 * W/16, C]`
  (the pipeline's `latents=` form); sizes are multiples of 32, since the transformer seats each
  2x2 group of latent tokens in one slot of the text sequence (`img_mask`).
- The transformer is one block-causal stream: the target image's tokens follow the text, and
  their rotary positions start where the text ends, so a prompt's length changes the computation
  and the layout is one per forward. Rows whose prompts differ in length run in separate forwards
  (no padding), so a request alone equals the same request in any batch.
- Guidance: `true_cfg_scale` > 1 with a `negative_prompt` is plain classifier-free guidance (no
  rescale to the conditional norm, unlike Qwen-Image); the pipeline's default 1.0 is off.
- The pipeline caches the text's keys and values after the first step (`use_kv_cache`, exact up to
  rounding under `causal_condition`); the engine recomputes them each step, since its batches mix
  requests at different steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollout.device_copy import row_index
from rollout.model_spec import ModelSpec
from rollout.pipelines.adapter import PipelineAdapter
from rollout.pipelines.families.qwen_image.adapter import QwenImageEmbeds, decode_normalised
from rollout.pipelines.flow_shift import resolution_shift

# The pipeline's default `output_resolution`: a 1024x1024 image when no size is given.
DEFAULT_RESOLUTION = 1024
# Latent tokens per slot of the text sequence (the transformer's `_IMG_TOKENS_PER_SLOT`: 2x2).
TOKENS_PER_SLOT = 4


class QwenImage21Adapter(PipelineAdapter):
    pipeline_class = "QwenImage21Pipeline"
    # The attention projections of the single stream (as the first four of Qwen-Image's targets).
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")

    @classmethod
    def given_components(cls, path: Path) -> dict[str, Any]:
        # The pipeline's Qwen3VLProcessor, made without torchvision where it is missing
        # (qwen_vl_processor.py). Imported here: the registry imports this file.
        from rollout.pipelines.qwen_vl_processor import load_qwen_vl_processor

        return {"processor": load_qwen_vl_processor(path / "processor", version=3)}

    def make_spec(self) -> ModelSpec:
        pipeline = self.pipeline
        return ModelSpec(
            pipeline_class=self.pipeline_class,
            latent_channels=self.transformer.config.in_channels // TOKENS_PER_SLOT,
            # Stated as half the VAE's scale with 2x2 packing, so that the latent shape comes out
            # as [H/16 * W/16, C] and sizes as multiples of 32 (one text slot per 2x2 group).
            vae_scale_factor=pipeline.vae_scale_factor // 2,
            patch_size=2,
            latent_packing=2,
            default_height=DEFAULT_RESOLUTION,
            default_width=DEFAULT_RESOLUTION,
            # The pipeline reads whole prompts: a request may not set max_sequence_length.
            default_max_sequence_length=4096,
            max_sequence_length_limit=4096,
            takes_max_sequence_length=False,
            guidance_defaults={"true_cfg_scale": 1.0},
            cfg_field="true_cfg_scale",
        )

    def encode_prompt(self, text: str, max_sequence_length: int) -> QwenImageEmbeds:
        embeds, _, _ = self.pipeline.encode_prompt(prompt=[text], device=self.device)  # one prompt: no padding
        mask = torch.ones(embeds.shape[1], dtype=torch.bool, device=self.device)
        return QwenImageEmbeds(embeds[0], mask).to(self.device, self.dtype)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int, sigmas) -> None:
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import retrieve_timesteps

        # QwenImage21Pipeline.__call__ step 4: the folder's `sample_sigmas` stand in for the
        # default schedule (their length is the step count), on this scheduler.
        if sigmas is None:
            sigmas = self.pipeline.config.sample_sigmas
            if sigmas is not None and len(sigmas) != num_steps:
                raise ValueError(
                    f"this folder samples with its {len(sigmas)} sample_sigmas; use num_inference_steps="
                    f"{len(sigmas)} or pass sigmas="
                )
            if sigmas is None:
                sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        mu = resolution_shift(scheduler.config, self.spec.latent_shape(height, width)[0])
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)

    def run_transformer(self, latents, sigmas, embeds: QwenImageEmbeds, guidance_scale, height, width) -> torch.Tensor:
        # Rows grouped by their prompt's length, known on the host (`stack`; one prompt's mask is
        # all True): summing the mask and reading the sums would make the host wait for the device.
        groups: dict[int, list[int]] = {}
        for row, length in enumerate(embeds.lengths):
            groups.setdefault(length, []).append(row)
        if len(groups) == 1:
            (length,) = groups
            return self._forward(latents, sigmas, embeds.prompt_embeds[:, :length], height, width)
        velocity = torch.empty_like(latents)
        for length in sorted(groups):
            rows = row_index(groups[length], latents.shape[0], latents.device)
            part = self._forward(latents[rows], sigmas[rows], embeds.prompt_embeds[rows, :length], height, width)
            velocity = velocity.index_put((rows,), part)
        return velocity

    def _forward(self, latents, sigmas, prompt_embeds, height: int, width: int) -> torch.Tensor:
        """One forward of rows whose prompts have one length (no padding), as the pipeline's."""
        batch, tokens = latents.shape[:2]
        text = prompt_embeds.shape[1]
        slots = torch.ones(batch, text + tokens // TOKENS_PER_SLOT, dtype=torch.bool, device=latents.device)
        slots[:, :text] = False
        grid = self.pipeline.vae_scale_factor
        out = self.transformer(
            hidden_states=latents,
            timestep=(sigmas * self._scheduler.config.num_train_timesteps).to(latents.dtype) / 1000,
            encoder_hidden_states=prompt_embeds,
            encoder_hidden_states_mask=None,
            img_shapes=[[(1, height // grid, width // grid)]] * batch,
            img_mask=slots,
            return_dict=False,
        )[0]
        return out[:, -tokens:]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        unpacked = self.pipeline._unpack_latents(latents, height, width, self.pipeline.vae_scale_factor)
        return decode_normalised(self.pipeline.vae, unpacked)
