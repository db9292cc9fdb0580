"""A tiny `Flux2KleinPipeline` (FLUX.2 [klein]'s layout: a Qwen3 text encoder read at three layers,
the FLUX.2 VAE with its 2x2 patchify and batch norm, colour-faithful), all random."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.families.flux.tiny import FLUX_SCHEDULER
from rollout.pipelines.sampling_defaults import SamplingDefaults
from rollout.pipelines.tiny.builder import Preset, block_sizes, published_config, real_sizes, small_sizes, tiny_builder
from rollout.pipelines.tiny.colour import make_decoder_colour_faithful
from rollout.pipelines.tiny.saving import TINY_IMAGE, save
from rollout.pipelines.tiny.text_encoders import mistral3_encoder, qwen3_encoder
from rollout.pipelines.tiny.tokenizers import content_list_tokenizer, qwen3_tokenizer

# The scheduler diffusers' FLUX.2 conversion script gives its pipelines (FLUX.1-dev's
# scheduler_config.json). Flux2KleinPipeline passes its own `mu` (compute_empirical_mu), so of
# these only use_dynamic_shifting (and time_shift_type's default, exponential) shape the schedule.
FLUX2_SCHEDULER = FLUX_SCHEDULER
# Flux2KleinPipeline reads Qwen3's hidden states after these layers (text_encoder_out_layers'
# default), so the text encoder needs at least the last of them; Flux2Pipeline reads Mistral 3's
# after layers 10, 20 and 30.
TEXT_LAYERS = 27
DEV_TEXT_LAYERS = 30


@dataclass(frozen=True)
class TinyFlux2KleinSizes:
    """Sizes of the tiny pipeline: 32x32 images from 16x16x4 latents, patchified to 16 x 8 x 8
    (64 tokens of 16)."""

    latent_channels: int = 4  # the VAE's (FLUX.2's has 32); the transformer sees 4x as many
    num_layers: int = 1  # double-stream blocks
    num_single_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, ...] = (4, 4, 4, 4)  # (t, h, w, l); sums to attention_head_dim
    text_hidden_size: int = 32  # Qwen3's width; the transformer's text width is 3x (three layers)
    vae_block_out_channels: tuple[int, ...] = (8, 16)  # two blocks: the VAE downsamples by 2
    distilled: bool = False  # a base model: true CFG with guidance_scale > 1 (True: step-distilled)
    sampling_defaults: SamplingDefaults | None = TINY_IMAGE  # an unsized request's (None: the pipeline's)


@tiny_builder(TinyFlux2KleinSizes())
def build_tiny_flux2_klein(path, seed, sizes, transformer_config, device, dtype) -> Path:
    """A tiny `Flux2KleinPipeline` (a `TinyBuilder`)."""
    return _build_tiny_flux2(path, seed, sizes, transformer_config, device, dtype, dev=False)


@tiny_builder(TinyFlux2KleinSizes())
def build_tiny_flux2_dev(path, seed, sizes, transformer_config, device, dtype) -> Path:
    """Build a `Flux2Pipeline` (FLUX.2 [dev]: a Mistral 3 text encoder read at layers 10, 20, 30, a
    guidance-distilled transformer; `sizes.distilled` is not used) as `build_tiny_flux2_klein`."""
    return _build_tiny_flux2(path, seed, sizes, transformer_config, device, dtype, dev=True)


def _build_tiny_flux2(path, seed, sizes, transformer_config, device, dtype, dev: bool) -> Path:
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Pipeline,
        Flux2Transformer2DModel,
    )

    tokenizer = content_list_tokenizer() if dev else qwen3_tokenizer()
    channels = sizes.latent_channels
    num_blocks = len(sizes.vae_block_out_channels)
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = Flux2Transformer2DModel(
            **transformer_config
            or {
                "patch_size": 1,
                "in_channels": 4 * channels,  # 2x2 patchified latents
                **block_sizes(sizes),
                "num_single_layers": sizes.num_single_layers,
                "joint_attention_dim": 3 * sizes.text_hidden_size,
                "axes_dims_rope": sizes.axes_dims_rope,
                "guidance_embeds": dev,  # FLUX.2 [dev] is guidance-distilled; no klein transformer is
            }
        )
        vae = AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D",) * num_blocks,
            up_block_types=("UpDecoderBlock2D",) * num_blocks,
            block_out_channels=sizes.vae_block_out_channels,
            layers_per_block=1,
            latent_channels=channels,
            # One group: per-channel GroupNorm would erase each latent channel's mean (families/sd3/tiny.py).
            norm_num_groups=1,
            sample_size=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        make_decoder_colour_faithful(vae)
        if dev:
            text_encoder = mistral3_encoder(tokenizer, sizes.text_hidden_size, DEV_TEXT_LAYERS)
        else:
            text_encoder = qwen3_encoder(tokenizer, sizes.text_hidden_size, TEXT_LAYERS)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER)
    components = dict(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipeline = Flux2Pipeline(**components) if dev else Flux2KleinPipeline(**components, is_distilled=sizes.distilled)
    return save(pipeline, path, dtype, sizes.sampling_defaults)


# Benchmark presets (benchmarks/model_presets.py), as in families/sd3/tiny.py.

# FLUX.2 [klein] 4B's transformer/config.json (the same for FLUX.2-klein-4B and -base-4B; diffusers'
# scripts/convert_flux2_to_diffusers.py writes the same values): 3.88B parameters; its joint_attention_dim
# 7680 is 3 x Qwen3-4B's 2560.
FLUX2_KLEIN_4B = published_config(__file__, "flux2_klein_4b.json")
# FLUX.2 [klein] 9B's (from the same script): 9.08B parameters, text from Qwen3-8B (4096 wide).
FLUX2_KLEIN_9B = FLUX2_KLEIN_4B | {
    "num_layers": 8,
    "num_single_layers": 24,
    "num_attention_heads": 32,
    "joint_attention_dim": 12288,
}


# The small preset's transformer: 2 double and 4 single blocks (of `SMALL_PARTS`' 4 x 32 heads).
SMALL_SIZES = small_sizes(TinyFlux2KleinSizes, num_layers=2, num_single_layers=4, axes_dims_rope=(8, 8, 8, 8))
# FLUX.2 [klein] 4B's transformer (3.88B parameters) with random weights, a text encoder of Qwen3-4B's
# width (27 layers, the deepest the pipeline reads; 2x-wide MLPs: about 1.5B parameters), and a narrow
# VAE with the real scale factor and latent channels (32).
build_small_flux2_klein = Preset(build_tiny_flux2_klein, SMALL_SIZES)
KLEIN_REAL_SIZES = real_sizes(TinyFlux2KleinSizes, latent_channels=32, text_hidden_size=2560)
build_real_flux2_klein = Preset(build_tiny_flux2_klein, KLEIN_REAL_SIZES, FLUX2_KLEIN_4B)


# FLUX.2 [dev]'s transformer: Flux2Transformer2DModel's defaults in diffusers 0.42.1, which are the
# dev model's (8 double and 48 single blocks of 48 x 128 heads, 3 x Mistral Small 3.1's 5120-wide
# hidden states, a guidance embedding): about 32B parameters.
FLUX2_DEV = FLUX2_KLEIN_4B | {
    "num_layers": 8,
    "num_single_layers": 48,
    "num_attention_heads": 48,
    "joint_attention_dim": 15360,
    "guidance_embeds": True,
}


# As the klein presets, with FLUX.2 [dev]'s text encoder and guidance embedding. The real one: FLUX.2
# [dev]'s transformer (about 32B parameters: bfloat16 on an H200) with random weights, a text encoder of
# Mistral Small 3.1's width (30 layers, the deepest the pipeline reads), and a narrow VAE with the real
# scale factor and latent channels (32).
build_small_flux2_dev = Preset(build_tiny_flux2_dev, SMALL_SIZES)
DEV_REAL_SIZES = real_sizes(TinyFlux2KleinSizes, latent_channels=32, text_hidden_size=5120)
build_real_flux2_dev = Preset(build_tiny_flux2_dev, DEV_REAL_SIZES, FLUX2_DEV)
