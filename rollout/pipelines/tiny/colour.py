"""Random VAE decoders made roughly "latent channel c paints colour c".

With random weights every latent decodes to nearly the same mean colour (measured on the SD3 VAE:
a per-image std of 0.002 in [0, 1] RGB), so no policy could learn a colour reward. Here each
residual branch keeps only a tenth of its random weights (a near-identity block), the input conv
copies the latent channels into the first feature channels, upsamplers and channel-reducing
shortcuts pass features through, and the output conv paints the first channels with
`CHANNEL_COLOURS`. The decoders stay the real diffusers classes, saved and loaded as usual.
"""

from __future__ import annotations

import torch

# Colour (RGB, before the decoder's [-1, 1] -> [0, 1] map) that each of the first latent channels paints.
CHANNEL_COLOURS = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.5, 0.5, 0.5))
TEXTURE_SCALE = 0.1  # what is left of the random weights: a little texture on top of the colour map


@torch.no_grad()
def make_decoder_colour_faithful(vae) -> None:
    """For an `AutoencoderKL` (SD3, FLUX.1): an offset of 1 in one latent channel then moves the
    image's mean colour by about 0.2 towards that channel's colour."""
    decoder = vae.decoder
    latent_channels = decoder.conv_in.in_channels
    add_identity(decoder.conv_in, latent_channels)
    for resnet in [*decoder.mid_block.resnets, *(r for block in decoder.up_blocks for r in block.resnets)]:
        add_identity(resnet.conv2, 0)
        if resnet.conv_shortcut is not None:
            add_identity(resnet.conv_shortcut, resnet.conv_shortcut.out_channels, texture=0.0)
    for block in decoder.up_blocks:
        for upsampler in block.upsamplers or []:
            add_identity(upsampler.conv, upsampler.conv.out_channels)
    for attention in decoder.mid_block.attentions:
        attention.to_out[0].weight.mul_(TEXTURE_SCALE)
        attention.to_out[0].bias.zero_()
    paint_colours(decoder.conv_out, latent_channels)


@torch.no_grad()
def make_causal_decoder_colour_faithful(vae) -> None:
    """For the causal 3D decoder of `AutoencoderKLQwenImage`. Its output norm keeps only each
    pixel's direction in feature space, so the colour follows which latent channels dominate."""
    decoder = vae.decoder
    latent_channels = decoder.conv_in.in_channels
    add_identity(vae.post_quant_conv, latent_channels, texture=0.0)
    add_identity(decoder.conv_in, latent_channels)
    for resnet in [*decoder.mid_block.resnets, *(r for block in decoder.up_blocks for r in block.resnets)]:
        add_identity(resnet.conv2, 0)
        if isinstance(resnet.conv_shortcut, torch.nn.Conv3d):  # channels change: pass the ones both sides have
            shortcut = resnet.conv_shortcut
            add_identity(shortcut, min(shortcut.in_channels, shortcut.out_channels), texture=0.0)
    for block in decoder.up_blocks:
        for upsampler in block.upsamplers or []:
            conv = upsampler.resample[1]  # after the nearest-neighbour upsample
            add_identity(conv, conv.out_channels)
    for attention in decoder.mid_block.attentions:
        attention.proj.weight.mul_(TEXTURE_SCALE)
        attention.proj.bias.zero_()
    paint_colours(decoder.conv_out, latent_channels)


def add_identity(conv: torch.nn.Module, channels: int, texture: float = TEXTURE_SCALE) -> None:
    """conv.weight *= texture, then input channel i feeds output channel i (i < channels) through
    the kernel tap that sees the same pixel (and, for a causal 3D conv, the current frame); the
    bias is zeroed."""
    conv.weight.mul_(texture)
    conv.weight[(range(channels), range(channels), *_current_tap(conv))] += 1.0
    conv.bias.zero_()


def paint_colours(conv_out: torch.nn.Module, latent_channels: int) -> None:
    add_identity(conv_out, 0)
    for channel, colour in enumerate(CHANNEL_COLOURS[:latent_channels]):
        conv_out.weight[(slice(None), channel, *_current_tap(conv_out))] += torch.tensor(colour)


def _current_tap(conv: torch.nn.Module) -> tuple[int, ...]:
    """Kernel indices of the tap on the output's own pixel: the spatial centre and, for a 3D
    conv, the last frame (causal convs pad only the past, so the last tap is the current frame)."""
    kernel = conv.kernel_size
    spatial = tuple(k // 2 for k in kernel[-2:])
    return (kernel[0] - 1, *spatial) if len(kernel) == 3 else spatial
