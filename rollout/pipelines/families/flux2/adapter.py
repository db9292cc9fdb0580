"""FLUX.2 [klein] (`Flux2KleinPipeline`): the 4B and 9B models, base and distilled; text-to-image,
and edits from reference images.

Latents are the VAE's latents patchified 2x2 into channels, [C*4, h/2, w/2] (C = 32 for FLUX.2's
VAE), the form `Flux2KleinPipeline` takes as `latents=`; each forward packs them into h/2 * w/2
tokens and unpacks the prediction. Conditioning is Qwen3's hidden states of the prompt in its chat
template, three layers concatenated per token ([max_sequence_length, 3 * D], padded to the length
and not masked, as the pipeline feeds them).

Guidance, as the pipeline defines it: the klein transformers take no guidance input (the pipeline
passes `guidance=None`). A base model (`is_distilled` false in the folder's model_index.json) runs
true classifier-free guidance with `guidance_scale` > 1 (default 4.0) in a second pass, against the
empty negative prompt "" unless a request names one (the pipeline's `negative_prompt_embeds`). A
step-distilled model ignores `guidance_scale`, so this adapter takes no guidance field for it and
refuses one.

Reference images (the pipeline's `image=`, 0 to 4 per request) are encoded as
`Flux2KleinPipeline.__call__` step 4 and `prepare_image_latents` encode them: an image above a
megapixel is first resized to one (keeping its aspect), each side is cropped down to a multiple of 2x
the VAE's scale, the VAE's mode is patchified 2x2 and normalised by the VAE's batch-norm statistics,
and the tokens of every image, in order, go after the noisy tokens in every forward (the
unconditional pass of CFG's too), at position ids (t, h, w, 0) with t = 10 for the first image, 20
for the second, ... (the noisy tokens' t is 0); the prediction is read off the noisy tokens. An edit
that sets no size is made at its first image's size as the pipeline rounds it (`ModelSpec.edit_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout.condition import PromptEmbeds
from rollout.input_images import InputImages
from rollout.model_spec import ModelSpec
from rollout.pipelines.adapter import PipelineAdapter, images_to_uint8


@dataclass
class Flux2KleinEmbeds(PromptEmbeds):
    """prompt_embeds: [L, 3 * D] Qwen3 hidden states (L = max_sequence_length, padding included).
    The text position ids FLUX.2 also takes follow from L, made per forward pass."""

    prompt_embeds: torch.Tensor


@dataclass
class Flux2KleinImages(PromptEmbeds):
    """latents: [N, C*4] the reference images' tokens (patchified, batch-normalised VAE latents, the
    images' tokens one after the other: N = the sum of their latent grids); ids: [N, 4] their
    position ids (t, h, w, l), int64, t = 10 * (1 + the image's index)."""

    latents: torch.Tensor
    ids: torch.Tensor


# Flux2KleinPipeline.__call__ step 4 resizes a reference image above this many pixels down to it,
# and Flux2ImageProcessor.check_image_input refuses an image smaller than 64 pixels on a side or
# longer than 8x its other side.
MAX_REFERENCE_AREA = 1024 * 1024
MIN_REFERENCE_SIDE = 64
MAX_REFERENCE_ASPECT_RATIO = 8.0
# The pipeline takes any number; Black Forest Labs' editing guide gives FLUX.2 [klein] 4B and 9B "up
# to 4" reference images (docs.bfl.ml/guides/prompting_editing_overview).
MAX_REFERENCE_IMAGES = 4


class Flux2KleinAdapter(PipelineAdapter):
    pipeline_class = "Flux2KleinPipeline"
    # diffusers' FLUX.2 [klein] LoRA script (examples/dreambooth/train_dreambooth_lora_flux2_klein.py)
    # targets to_q/k/v/out.0 and the single blocks' fused to_qkv_mlp_proj and to_out; here, as
    # Flow-GRPO's FLUX.1 targets, the double blocks' feed-forwards and text-stream projections too.
    # The single blocks' `attn.to_out` is left out: as a suffix it also names the double blocks'
    # `attn.to_out` ModuleList, which PEFT cannot wrap (the script lists it per block index).
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
    )

    def make_spec(self) -> ModelSpec:
        pipeline = self.pipeline
        size = pipeline.default_sample_size * pipeline.vae_scale_factor
        return ModelSpec(
            pipeline_class=self.pipeline_class,
            latent_channels=self.transformer.config.in_channels,  # the VAE's channels x 4: patchified
            # The VAE's scale times the 2x2 patchify: latents are [C*4, H / (vae*2), W / (vae*2)].
            vae_scale_factor=pipeline.vae_scale_factor * 2,
            patch_size=1,
            latent_packing=1,
            default_height=size,
            default_width=size,
            default_max_sequence_length=512,
            max_sequence_length_limit=pipeline.tokenizer_max_length,
            **self.guidance_spec(),
            max_input_images=MAX_REFERENCE_IMAGES,
            min_input_image_side=MIN_REFERENCE_SIDE,
            max_input_image_aspect_ratio=MAX_REFERENCE_ASPECT_RATIO,
            max_input_image_area=MAX_REFERENCE_AREA,
        )

    def guidance_spec(self) -> dict:
        """The spec's guidance fields: a base klein model's true CFG with `guidance_scale` (the
        pipeline's default 4.0, against ""), none for a step-distilled one."""
        if self.pipeline.config.is_distilled:
            return {"guidance_defaults": {}, "cfg_field": None, "default_negative_prompt": None}
        return {
            "guidance_defaults": {"guidance_scale": 4.0},
            "cfg_field": "guidance_scale",
            "default_negative_prompt": "",
        }

    def guidance_input(self, guidance_scale: torch.Tensor | None) -> torch.Tensor | None:
        """The transformer's `guidance` input for rows of `guidance_scale`: none for klein, whose
        scale is CFG's (combined in predict_velocity)."""
        return None

    def encode_prompt(self, text: str, max_sequence_length: int) -> Flux2KleinEmbeds:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=[text], device=self.device, max_sequence_length=max_sequence_length
        )
        return Flux2KleinEmbeds(embeds[0]).to(self.device, self.dtype)

    def encode_images(self, images: InputImages) -> Flux2KleinImages:
        # Flux2KleinPipeline.__call__ step 4 and prepare_image_latents (which draws no noise: the
        # VAE's mode), on each image in order.
        pipeline = self.pipeline
        processor = pipeline.image_processor
        multiple = pipeline.vae_scale_factor * 2
        pixels = []
        for image in images.pil():
            processor.check_image_input(image)
            if image.width * image.height > MAX_REFERENCE_AREA:
                image = processor._resize_to_target_area(image, MAX_REFERENCE_AREA)
            width, height = image.width // multiple * multiple, image.height // multiple * multiple
            pixels.append(processor.preprocess(image, height=height, width=width, resize_mode="crop"))
        latents, ids = pipeline.prepare_image_latents(
            images=pixels, batch_size=1, generator=None, device=self.device, dtype=pipeline.vae.dtype
        )
        return Flux2KleinImages(latents[0], ids[0]).to(self.device, self.dtype)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int, sigmas) -> None:
        # Imported here, once a pipeline is loaded: the pipeline's module imports transformers' image
        # processors, slow and noisy at import (a torchvision notice), and the registry imports this file.
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps

        # Flux2KleinPipeline.__call__ step 6, on this scheduler: the shift depends on the token count
        # and on the number of steps.
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if scheduler.config.get("use_flow_sigmas"):
            sigmas = None
        _, h, w = self.spec.latent_shape(height, width)
        mu = compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)

    def run_transformer(
        self,
        latents,
        sigmas,
        embeds: Flux2KleinEmbeds,
        guidance_scale,
        height,
        width,
        images: Flux2KleinImages | None = None,
    ):
        batch, channels, h, w = latents.shape
        hidden_states, image_ids = self._model_inputs(latents)
        if images is not None:  # the rows of a batch hold reference images of the same sizes
            hidden_states = torch.cat([hidden_states, images.latents.to(hidden_states.dtype)], dim=1)
            image_ids = torch.cat([image_ids, images.ids.to(image_ids.device)], dim=1)
        text_ids = self.pipeline._prepare_text_ids(embeds.prompt_embeds).to(latents.device)
        # The pipeline feeds the scheduler's timestep (sigma * 1000) in the latents' dtype, over 1000.
        timestep = (sigmas * self._scheduler.config.num_train_timesteps).to(latents.dtype) / 1000
        prediction = self.transformer(
            hidden_states=hidden_states,
            timestep=timestep,
            guidance=self.guidance_input(guidance_scale),
            encoder_hidden_states=embeds.prompt_embeds,
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]
        # Tokens in row-major grid order (the ids' order): unpacking is the packing's transpose.
        return prediction[:, : h * w].transpose(1, 2).reshape(batch, channels, h, w)

    def _model_inputs(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The noisy latents [B, C, h, w] as the transformer's tokens [B, h*w, C] and their position
        ids [B, h*w, 4] (t, h, w, l), as `Flux2KleinPipeline.prepare_latents` makes them."""
        ids = self.pipeline._prepare_latent_ids(latents).to(latents.device)
        return self.pipeline._pack_latents(latents), ids

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.device, vae.dtype)
        # Flux2KleinPipeline.__call__ after the loop: undo the batch norm, unpatchify, decode.
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        std = std.to(latents.device, latents.dtype)
        unpatchified = self.pipeline._unpatchify_latents(latents * std + mean)
        return images_to_uint8(vae.decode(unpatchified, return_dict=False)[0])
