"""Pipelines the throughput benchmark builds (random weights, nothing downloaded), per family.

small  a transformer big enough to dominate the time on a CPU, tiny text encoders and VAE: the
       engine's overhead shows against real model work in seconds;
real   the transformer of the published model (SD3.5 Medium, FLUX.1-dev, Qwen-Image) from its
       config with random weights, text encoders one layer deep but of the real widths, and a
       small VAE with the real scale factor and latent channels: a GPU measurement of the real
       per-step work. The transformers have 2.5B, 12B and 20B parameters: build them on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.pipelines.tiny import (
    TinyFluxSizes,
    TinyQwenImageSizes,
    TinySD3Sizes,
    build_tiny_flux,
    build_tiny_qwen_image,
    build_tiny_sd3,
)

PRESETS = ("small", "real")

# Image side each preset samples at by default (pixels): 256 image tokens for the small models, as
# for the real ones at 512x512 (VAE scale 8, 2x2 patches).
DEFAULT_SIZE = {"small": 64, "real": 512}

# The published transformer configs (config.json of each model's transformer folder).
SD35_MEDIUM = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)),
    "qk_norm": "rms_norm",
}
FLUX1_DEV = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
QWEN_IMAGE = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}
# A VAE with 4 blocks scales by 8, as the real ones do; narrow, so decoding stays cheap.
REAL_VAE_BLOCKS = (16, 16, 16, 16)


def build(family: str, preset: str, folder: str | Path, device: str, dtype: torch.dtype) -> Path:
    """Build the benchmark pipeline of `family` and `preset` into `folder`: modules made on `device`,
    saved in `dtype` (a real transformer is made on the GPU and saved in bfloat16)."""
    if preset == "small":
        return _build_small(family, folder)
    return _build_real(family, folder, device, dtype)


def _build_small(family: str, folder) -> Path:
    if family == "sd3":
        sizes = TinySD3Sizes(sample_size=32, num_layers=4, num_attention_heads=4, attention_head_dim=32)
        return build_tiny_sd3(folder, sizes=sizes)
    if family == "flux":
        sizes = TinyFluxSizes(
            num_layers=2, num_single_layers=4, num_attention_heads=4, attention_head_dim=32, axes_dims_rope=(8, 12, 12)
        )
        return build_tiny_flux(folder, sizes=sizes)
    sizes = TinyQwenImageSizes(num_layers=4, num_attention_heads=4, attention_head_dim=32, axes_dims_rope=(8, 12, 12))
    return build_tiny_qwen_image(folder, sizes=sizes)


def _build_real(family: str, folder, device: str, dtype: torch.dtype) -> Path:
    if family == "sd3":
        sizes = TinySD3Sizes(
            latent_channels=16,
            text_hidden_size=1024,  # two CLIPs of 1024: pooled 2048, as CLIP-L + CLIP-G give
            t5_hidden_size=4096,
            text_layers=1,
            vae_block_out_channels=REAL_VAE_BLOCKS,
        )
        return build_tiny_sd3(folder, sizes=sizes, transformer_config=SD35_MEDIUM, device=device, dtype=dtype)
    if family == "flux":
        sizes = TinyFluxSizes(
            latent_channels=16,
            text_hidden_size=768,  # CLIP-L
            t5_hidden_size=4096,
            text_layers=1,
            vae_block_out_channels=REAL_VAE_BLOCKS,
        )
        return build_tiny_flux(folder, sizes=sizes, transformer_config=FLUX1_DEV, device=device, dtype=dtype)
    sizes = TinyQwenImageSizes(latent_channels=16, text_hidden_size=3584, text_layers=1, vae_dim_mult=(1, 2, 4, 4))
    return build_tiny_qwen_image(folder, sizes=sizes, transformer_config=QWEN_IMAGE, device=device, dtype=dtype)
