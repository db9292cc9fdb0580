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
    latent_channels = pass_latents_through_causal_resnets(vae, torch.nn.Conv3d)
    for block in decoder.up_blocks:
        for upsampler in block.upsamplers or []:
            conv = upsampler.resample[1]  # after the nearest-neighbour upsample
            add_identity(conv, conv.out_channels)
    quiet_causal_attention(decoder)
    paint_colours(decoder.conv_out, latent_channels)


def pass_latents_through_causal_resnets(vae, shortcut_class: type) -> int:
    """The part every causal decoder (Qwen-Image's, Qwen-Image 2.1's) shares: the post-quant and
    input convs copy the latents into the first feature channels and the residual blocks stay near
    identity, their channel-changing shortcuts (of `shortcut_class`) passing on the channels both
    sides have. Returns the number of latent channels."""
    decoder = vae.decoder
    latent_channels = decoder.conv_in.in_channels
    add_identity(vae.post_quant_conv, latent_channels, texture=0.0)
    add_identity(decoder.conv_in, latent_channels)
    for resnet in [*decoder.mid_block.resnets, *(r for block in decoder.up_blocks for r in block.resnets)]:
        add_identity(resnet.conv2, 0)
        if isinstance(resnet.conv_shortcut, shortcut_class):  # channels change: pass the ones both sides have
            shortcut = resnet.conv_shortcut
            add_identity(shortcut, min(shortcut.in_channels, shortcut.out_channels), texture=0.0)
    return latent_channels


def quiet_causal_attention(decoder) -> None:
    """A causal decoder's mid-block attention keeps a tenth of its output projection, no bias."""
    for attention in decoder.mid_block.attentions:
        attention.proj.weight.mul_(TEXTURE_SCALE)
        attention.proj.bias.zero_()


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


@torch.no_grad()
def make_dcae_video_decoder_colour_faithful(vae) -> None:
    """For `AutoencoderKLHunyuanVideo15`'s decoder (DC-AE's shortcuts): its input conv adds the
    latents repeated over its feature channels, and each upsampler adds a copy of its input whose
    channels it shuffles into sub-pixel positions (a latent channel would come out as a pixel
    phase, not a colour). Here each residual branch keeps a tenth of its random weights, and each
    upsampler's conv cancels that shuffle and adds a nearest-neighbour upsample that keeps channel
    k on channel k (of a wider input: its channel k * in / out), exactly on every frame after the
    first (a time upsample's first frame reads the same conv: there one channel pair of its
    shuffle is left as texture); then the output conv paints each last feature channel with the
    colour of the latent channel that raises it most (probed with one-channel latents)."""
    decoder = vae.decoder
    if decoder.conv_in.conv.weight.is_meta:  # the memory plan's build holds shapes, no colours to paint
        return
    latent_channels = decoder.in_channels
    decoder.conv_in.conv.weight.mul_(TEXTURE_SCALE)
    decoder.conv_in.conv.bias.zero_()
    for resnet in [*decoder.mid_block.resnets, *(r for block in decoder.up_blocks for r in block.resnets)]:
        resnet.conv2.conv.weight.mul_(TEXTURE_SCALE)
        resnet.conv2.conv.bias.zero_()
        if resnet.conv_shortcut is not None:  # channels change: pass the ones both sides have
            shortcut = resnet.conv_shortcut
            add_identity(shortcut, min(shortcut.in_channels, shortcut.out_channels), texture=0.0)
    for attention in decoder.mid_block.attentions:
        attention.proj_out.weight.mul_(TEXTURE_SCALE)
        attention.proj_out.bias.zero_()
    for block in decoder.up_blocks:
        for upsampler in block.upsamplers or []:
            _unshuffle_upsampler(upsampler)
    features = []
    hook = decoder.conv_out.register_forward_hook(
        lambda module, args, out: features.append(args[0].mean((0, 2, 3, 4)))
    )
    try:
        painted = min(latent_channels, len(CHANNEL_COLOURS))
        for channel in range(painted + 1):  # each painted channel alone, then none
            latents = torch.zeros(1, latent_channels, 2, 2, 2)
            if channel < painted:
                latents[:, channel] = 2.0
            decoder(latents)
    finally:
        hook.remove()
    response = torch.stack(features[:painted]) - features[painted]  # [painted, feature channels]
    conv_out = decoder.conv_out.conv
    add_identity(conv_out, 0)
    colours = torch.tensor(CHANNEL_COLOURS[:painted])
    for feature, (gain, channel) in enumerate(zip(*response.max(dim=0), strict=True)):
        if gain > 0:
            conv_out.weight[(slice(None), feature, *_current_tap(conv_out))] += colours[channel] / gain


def _unshuffle_upsampler(upsampler) -> None:
    """`HunyuanVideo15Upsample`'s output = its conv's channels rearranged into 2x2 (x2 in time)
    sub-positions + its shortcut, the input's channels repeated and rearranged alike. The conv's
    current tap is set so that at every sub-position output channel k is input channel k * in / out."""
    conv = upsampler.conv.conv
    tap = _current_tap(conv)
    inputs, packed = conv.in_channels, conv.out_channels
    temporal = upsampler.add_temporal_upsample
    factor = 8 if temporal else 4
    outputs = packed // factor
    repeats = factor * outputs // inputs
    conv.weight.mul_(TEXTURE_SCALE)
    conv.bias.zero_()
    for position in range(factor):
        for k in range(outputs):
            row = position * outputs + k
            # The shortcut's source of (position, k): rearranged then repeated in time upsamples
            # (frames after the first), repeated then rearranged otherwise.
            shortcut = position * (inputs // factor) + k // repeats if temporal else row // repeats
            conv.weight[(row, k * inputs // outputs, *tap)] += 1.0
            conv.weight[(row, shortcut, *tap)] -= 1.0
