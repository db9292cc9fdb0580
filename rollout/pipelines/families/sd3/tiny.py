"""A tiny `StableDiffusion3Pipeline`: two CLIP encoders, a one-layer T5 (as SD3.5 has), a small
transformer and a colour-faithful VAE, all random."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.tiny.builder import Preset, block_sizes, published_config, real_sizes, small_sizes, tiny_builder
from rollout.pipelines.tiny.colour import make_decoder_colour_faithful
from rollout.pipelines.tiny.saving import save
from rollout.pipelines.tiny.text_encoders import clip_text_encoder, t5_encoder
from rollout.pipelines.tiny.tokenizers import clip_tokenizer, t5_tokenizer


@dataclass(frozen=True)
class TinySD3Sizes:
    """Sizes of the tiny pipeline. The defaults give 32x32 images from 16x16x4 latents."""

    sample_size: int = 16  # latent height/width the transformer is built for
    patch_size: int = 2
    latent_channels: int = 4
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    text_hidden_size: int = 32  # CLIP width; the pooled projections are 2 * this
    t5_hidden_size: int | None = None  # T5's width, the transformer's text width; None: 2 * text_hidden_size
    text_layers: int = 2
    vae_block_out_channels: tuple[int, ...] = (8, 16)  # two blocks: the VAE downsamples by 2


def tiny_autoencoder_kl(latent_channels: int, block_out_channels: tuple[int, ...], sample_size: int):
    """An `AutoencoderKL` as SD3 and FLUX.1 use, with a colour-faithful decoder."""
    from diffusers import AutoencoderKL

    num_blocks = len(block_out_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * num_blocks,
        up_block_types=("UpDecoderBlock2D",) * num_blocks,
        block_out_channels=block_out_channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        # One group: per-channel GroupNorm would erase each latent channel's mean, and with it every
        # way for the latents to set an image's overall colour.
        norm_num_groups=1,
        sample_size=sample_size,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    make_decoder_colour_faithful(vae)
    return vae


@tiny_builder(TinySD3Sizes())
def build_tiny_sd3(path, seed, sizes, transformer_config, device, dtype, with_t5: bool = True) -> Path:
    """A tiny `StableDiffusion3Pipeline` (a `TinyBuilder`). `with_t5=False` leaves T5 out (SD3 then
    feeds zeros in its place); diffusers loads such a folder only with `text_encoder_3=None,
    tokenizer_3=None` (the engine passes them itself)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    tokenizer = clip_tokenizer()
    tokenizer_3 = t5_tokenizer() if with_t5 else None
    # The two CLIP encoders are concatenated along features and padded to T5's width.
    text_width = sizes.t5_hidden_size or 2 * sizes.text_hidden_size
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = SD3Transformer2DModel(
            **transformer_config
            or {
                "sample_size": sizes.sample_size,
                "patch_size": sizes.patch_size,
                "in_channels": sizes.latent_channels,
                "out_channels": sizes.latent_channels,
                **block_sizes(sizes),
                "caption_projection_dim": sizes.attention_head_dim * sizes.num_attention_heads,
                "joint_attention_dim": text_width,
                "pooled_projection_dim": 2 * sizes.text_hidden_size,
                "pos_embed_max_size": max(sizes.sample_size, 16),
            }
        )
        num_blocks = len(sizes.vae_block_out_channels)
        vae = tiny_autoencoder_kl(
            sizes.latent_channels, sizes.vae_block_out_channels, sizes.sample_size * 2 ** (num_blocks - 1)
        )
        text_encoder = clip_text_encoder(tokenizer, sizes.text_hidden_size, sizes.text_layers, with_projection=True)
        text_encoder_2 = clip_text_encoder(tokenizer, sizes.text_hidden_size, sizes.text_layers, with_projection=True)
        text_encoder_3 = t5_encoder(tokenizer_3, text_width) if with_t5 else None
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    clips = dict(text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer)
    t5 = dict(text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3)
    pipeline = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, **clips, **t5)
    return save(pipeline, path, dtype, None)  # its default: the transformer's sample_size


# Benchmark presets (benchmarks/model_presets.py): random weights at the sizes the throughput
# benchmark measures, built through the tiny builder.

# SD3.5 Medium's transformer/config.json.
SD35_MEDIUM = published_config(__file__, "sd35_medium.json")
# The small preset (`SMALL_PARTS`) makes 64x64 images: 256 tokens.
build_small_sd3 = Preset(build_tiny_sd3, small_sizes(TinySD3Sizes, sample_size=32))
# SD3.5 Medium's transformer (2.2B parameters) with random weights, one-layer text encoders of the
# real widths (two CLIPs of 1024: pooled 2048, as CLIP-L + CLIP-G give), and a narrow VAE with the
# real scale factor and latent channels.
REAL_SIZES = real_sizes(TinySD3Sizes, latent_channels=16, text_hidden_size=1024, t5_hidden_size=4096)
build_real_sd3 = Preset(build_tiny_sd3, REAL_SIZES, SD35_MEDIUM)
