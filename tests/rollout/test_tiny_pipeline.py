"""The tiny pipeline's decoder paints latent channels 0, 1, 2 as red, green, blue, so a colour reward
is learnable on it (a random decoder gives every latent the same mean colour)."""

from __future__ import annotations

import pytest
import torch

from rollout.pipelines.loading import load_adapter


@pytest.mark.timeout(60)
def test_latent_channels_set_the_image_colour(tiny_model):
    adapter = load_adapter(tiny_model)
    noise = torch.randn(8, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    base = adapter.decode(noise, 32, 32).float().mean(dim=(0, 2, 3)) / 255
    for channel in range(3):
        shifted = noise.clone()
        shifted[:, channel] += 1.5
        colour = adapter.decode(shifted, 32, 32).float().mean(dim=(0, 2, 3)) / 255
        change = colour - base
        assert change[channel] > 0.1, (channel, change)
        others = [c for c in range(3) if c != channel]
        assert (change[others] < change[channel] / 2).all(), (channel, change)
