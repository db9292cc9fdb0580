"""A tiny `ZImagePipeline`: a Qwen3 text encoder, the single-stream transformer (S3-DiT), FLUX.1's
kind of `AutoencoderKL` (colour-faithful), all random, with Z-Image-Turbo's scheduler settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.families.sd3.tiny import tiny_autoencoder_kl
from rollout.pipelines.sampling_defaults import SamplingDefaults
from rollout.pipelines.tiny.builder import Preset, published_config, real_sizes, small_sizes, tiny_builder
from rollout.pipelines.tiny.saving import TINY_IMAGE, save
from rollout.pipelines.tiny.text_encoders import qwen3_encoder
from rollout.pipelines.tiny.tokenizers import qwen3_tokenizer

# Z-Image-Turbo's scheduler_config.json: a fixed shift of 3, no dynamic shifting (so the pipeline's
# `mu` is computed but unused). Z-Image (the base model) publishes the same with shift 6.
Z_IMAGE_TURBO_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

# The rotary table's length per axis, as published: axis 0 numbers the caption tokens and then the
# image (a caption of up to 512 tokens comes first), axes 1 and 2 the image's rows and columns.
Z_IMAGE_AXES_LENS = (1536, 512, 512)


@dataclass(frozen=True)
class TinyZImageSizes:
    """Sizes of the tiny pipeline: 32x32 images from 4x16x16 latents, 64 tokens of 2x2 patches."""

    latent_channels: int = 4
    num_layers: int = 2
    num_refiner_layers: int = 1  # each of the noise and the context refiner
    num_heads: int = 2
    axes_dims: tuple[int, int, int] = (4, 6, 6)  # sums to the head dim; each even (rotary pairs)
    text_hidden_size: int = 32
    text_layers: int = 2
    vae_block_out_channels: tuple[int, ...] = (8, 16)  # two blocks: the VAE downsamples by 2
    sampling_defaults: SamplingDefaults | None = TINY_IMAGE  # an unsized request's (None: the pipeline's)


@tiny_builder(TinyZImageSizes())
def build_tiny_z_image(path, seed, sizes, transformer_config, device, dtype) -> Path:
    """A tiny `ZImagePipeline` (a `TinyBuilder`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = qwen3_tokenizer()
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = ZImageTransformer2DModel(
            **transformer_config
            or {
                "all_patch_size": (2,),
                "all_f_patch_size": (1,),
                "in_channels": sizes.latent_channels,
                "dim": sizes.num_heads * sum(sizes.axes_dims),
                "n_layers": sizes.num_layers,
                "n_refiner_layers": sizes.num_refiner_layers,
                "n_heads": sizes.num_heads,
                "n_kv_heads": sizes.num_heads,
                "cap_feat_dim": sizes.text_hidden_size,
                "axes_dims": list(sizes.axes_dims),
                "axes_lens": list(Z_IMAGE_AXES_LENS),
            }
        )
        vae = tiny_autoencoder_kl(sizes.latent_channels, sizes.vae_block_out_channels, 32)
        # Z-Image's model_index names a `Qwen3Model`: the causal LM's body, without its head.
        text_encoder = qwen3_encoder(tokenizer, sizes.text_hidden_size, sizes.text_layers).model
    scheduler = FlowMatchEulerDiscreteScheduler(**Z_IMAGE_TURBO_SCHEDULER)
    text = dict(text_encoder=text_encoder, tokenizer=tokenizer)
    pipeline = ZImagePipeline(scheduler=scheduler, vae=vae, transformer=transformer, **text)
    return save(pipeline, path, dtype, sizes.sampling_defaults)


# Benchmark presets (benchmarks/model_presets.py), as in families/sd3/tiny.py.

# Z-Image-Turbo's transformer/config.json (Z-Image, the base model, publishes the same one).
Z_IMAGE_TURBO = published_config(__file__, "z_image_turbo.json")


# The small preset's transformer: `SMALL_PARTS`' 4 layers, 2 + 2 refiners, 4 heads of 32.
SMALL_SIZES = small_sizes(TinyZImageSizes, num_refiner_layers=2, num_heads=4, axes_dims=(8, 12, 12))
build_small_z_image = Preset(build_tiny_z_image, SMALL_SIZES)
# Z-Image-Turbo's transformer (6.15B parameters) with random weights, a one-layer Qwen3 text encoder of
# the real width (Qwen3-4B's 2560), and a narrow VAE with the real scale factor and latent channels.
REAL_SIZES = real_sizes(TinyZImageSizes, latent_channels=16, text_hidden_size=2560)
build_real_z_image = Preset(build_tiny_z_image, REAL_SIZES, Z_IMAGE_TURBO)
