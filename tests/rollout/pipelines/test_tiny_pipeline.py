"""The tiny pipelines' decoders paint latent channels 0, 1, 2 as red, green, blue, so a colour
reward is learnable on every family (a random decoder gives every latent the same mean colour)."""

from __future__ import annotations

import pytest
import torch

from rollout.pipelines.loading import load_adapter
from tests.families import matrix


def _in_pipeline_form(adapter, latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] latents in the family's own form (packed 2x2 patches for FLUX, Qwen-Image;
    for FLUX.2, 2x2 patches in channels, normalised by the VAE's batch norm as its pipeline encodes)."""
    if adapter.pipeline_class in ("Flux2KleinPipeline", "Flux2Pipeline"):
        bn, eps = adapter.pipeline.vae.bn, adapter.pipeline.vae.config.batch_norm_eps
        patches = adapter.pipeline._patchify_latents(latents)
        return (patches - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps)
    if adapter.spec.latent_packing == 1:
        return latents
    batch, channels, height, width = latents.shape
    return type(adapter.pipeline)._pack_latents(latents, batch, channels, height, width)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", matrix())
def test_latent_channels_set_the_image_colour(tiny_models, family):
    adapter = load_adapter(tiny_models(family))
    # latents of a 32x32 image (the Qwen edit VAEs scale by 16; Qwen-Image 2.1's too, its spec stating
    # half of that with 2x2 packing, while its latents are the VAE's grid unpatched)
    scale = adapter.pipeline.vae_scale_factor if adapter.pipeline_class == "QwenImage21Pipeline" else None
    side = 32 // (scale or adapter.spec.vae_scale_factor)
    noise = torch.randn(8, 4, side, side, generator=torch.Generator().manual_seed(0))

    def mean_colour(latents):
        return adapter.decode(_in_pipeline_form(adapter, latents), 32, 32).float().mean(dim=(0, 2, 3)) / 255

    base = mean_colour(noise)
    for channel in range(3):
        shifted = noise.clone()
        shifted[:, channel] += 1.5
        change = mean_colour(shifted) - base
        assert change[channel] > 0.1, (channel, change)
        others = [c for c in range(3) if c != channel]
        assert (change[others] < change[channel] / 2).all(), (channel, change)
