"""FLUX.1 Kontext (`FluxKontextPipeline`): FLUX.1 that edits an input image.

The same transformer as FLUX.1: the input image's VAE latents, packed like the noisy latents, are
concatenated after the noisy tokens in every forward pass, at position ids whose first axis is 1
(the noisy tokens' is 0), and the prediction is read off the noisy tokens only. The unconditional
pass of true CFG sees the same image. Without an image the pipeline is FLUX.1's text-to-image, and
so is a text-only request here.

As the pipeline's default (`_auto_resize=True`), the input image is first resized to the nearest,
by aspect ratio, of `PREFERRED_KONTEXT_RESOLUTIONS` (about a megapixel); a request with
`auto_resize=False` skips that (`_auto_resize=False`). Either way it is then rounded down to a
multiple of 2x the VAE's scale and encoded with the VAE's mode (no sampling). An edit that sets no
size is made at the size its image was encoded at (the pipeline's own default is 1024 x 1024
rescaled to `max_area`): `pipeline(image=..., height=h, width=w, max_area=h * w,
_auto_resize=auto_resize)` is the engine's edit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rollout.condition import PromptEmbeds
from rollout.input_images import InputImages
from rollout.model_spec import ModelSpec
from rollout.pipelines.families.flux.adapter import FluxAdapter, FluxEmbeds


@dataclass
class KontextImages(PromptEmbeds):
    """latents: [N, C*4] the input image's packed VAE latents (shifted and scaled as the pipeline
    does); ids: [N, 3] their position ids, first axis 1."""

    latents: torch.Tensor
    ids: torch.Tensor


class FluxKontextAdapter(FluxAdapter):
    pipeline_class = "FluxKontextPipeline"

    def make_spec(self) -> ModelSpec:
        # Imported once a pipeline is loaded, as flux.py imports the FLUX.1 pipeline's module.
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        preferred = tuple((height, width) for width, height in PREFERRED_KONTEXT_RESOLUTIONS)
        return dataclasses.replace(super().make_spec(), max_input_images=1, preferred_input_sizes=preferred)

    def encode_images(self, images: InputImages) -> KontextImages:
        # FluxKontextPipeline.__call__ step 3 and prepare_latents; the resize of _auto_resize (its
        # default, unless the folder's sampling defaults turn it off) unless the request said otherwise.
        # The size is the spec's arithmetic (`encoded_image_sizes`), which the scheduler batches by.
        pipeline = self.pipeline
        (image,) = images.pil()
        auto_resize = images.setting("auto_resize", self.spec.default_auto_resize)
        ((height, width),) = self.spec.encoded_image_sizes(images.sizes, auto_resize)
        image = pipeline.image_processor.resize(image, height, width)
        pixels = pipeline.image_processor.preprocess(image, height, width).to(self.device, self.dtype)
        latents = pipeline._encode_vae_image(image=pixels, generator=None)  # the VAE's mode: no noise drawn
        _, channels, latent_height, latent_width = latents.shape
        packed = pipeline._pack_latents(latents, 1, channels, latent_height, latent_width)
        ids = pipeline._prepare_latent_image_ids(1, latent_height // 2, latent_width // 2, self.device, self.dtype)
        ids[..., 0] = 1
        return KontextImages(packed[0], ids).to(self.device, self.dtype)

    def run_transformer(
        self, latents, sigmas, embeds: FluxEmbeds, guidance_scale, height, width, images: KontextImages | None = None
    ) -> torch.Tensor:
        noisy_ids = self.image_ids(height, width, latents)
        if images is None:
            return self._forward(latents, noisy_ids, sigmas, embeds, guidance_scale)
        hidden_states = torch.cat([latents, images.latents], dim=1)
        ids = torch.cat([noisy_ids, images.ids[0]])  # the rows of a batch stack images of one size
        return self._forward(hidden_states, ids, sigmas, embeds, guidance_scale)[:, : latents.shape[1]]
