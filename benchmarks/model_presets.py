"""Pipelines the throughput benchmark builds (random weights, nothing downloaded), per family.

small  a transformer big enough to dominate the time on a CPU, tiny text encoders and VAE: the
       engine's overhead shows against real model work in seconds;
real   the transformer of the published model (SD3.5 Medium, FLUX.1-dev, Qwen-Image, Wan 2.1 T2V
       1.3B, Wan 2.2 T2V A14B) from its config with random weights, text encoders one layer deep
       but of the real widths, and a small VAE with the real scale factors and latent channels: a
       GPU measurement of the real per-step work. The transformers have 2.5B, 12B, 20B, 1.4B and
       2 x 14.3B parameters: build them on the GPU.

Video families (wan, wan22) sample `num_frames` frames of `height` x `width`; their default sizes
are in DEFAULT_VIDEO_SIZE and DEFAULT_NUM_FRAMES.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.pipelines.tiny import (
    TinyFluxSizes,
    TinyQwenImageSizes,
    TinySD3Sizes,
    TinyWanSizes,
    build_tiny_flux,
    build_tiny_qwen_image,
    build_tiny_sd3,
    build_tiny_wan,
    build_tiny_wan22,
)

PRESETS = ("small", "real")
VIDEO_FAMILIES = ("wan", "wan22")

# Image side each preset samples at by default (pixels): 256 image tokens for the small models, as
# for the real ones at 512x512 (VAE scale 8, 2x2 patches).
DEFAULT_SIZE = {"small": 64, "real": 512}
# Video (height, width) and frames per preset. small: the tiny VAE halves space and time, so 9 frames
# of 32x32 are 5 latent frames of 8x8 tokens (320 per video, about an image's 256 above); real:
# Wan's 480p at 33 frames, 9 latent frames of 30x52 tokens (14040 per video).
DEFAULT_VIDEO_SIZE = {"small": (32, 32), "real": (480, 832)}
DEFAULT_NUM_FRAMES = {"small": 9, "real": 33}

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
# Wan 2.1 T2V 1.3B and each of Wan 2.2 T2V A14B's two experts (diffusers' scripts/convert_wan_to_diffusers.py,
# "Wan-T2V-1.3B" and "Wan2.2-T2V-A14B"; the A14B's pipeline has boundary_ratio 0.875).
WAN21_T2V_1_3B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
WAN22_T2V_A14B_EXPERT = WAN21_T2V_1_3B | {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
# The small preset's Wan transformer (each expert of wan22): the tiny pipeline's latents (4 channels)
# and text width (32), 4 layers of 4 x 32 heads with a 4x MLP, as the other small presets.
WAN_SMALL = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 512,
    "num_layers": 4,
    "rope_max_seq_len": 64,
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
    if family in VIDEO_FAMILIES:
        return (build_tiny_wan if family == "wan" else build_tiny_wan22)(folder, transformer_config=WAN_SMALL)
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
    if family in VIDEO_FAMILIES:
        sizes = TinyWanSizes(
            latent_channels=16,
            text_hidden_size=4096,  # umt5-xxl
            vae_base_dim=24,  # narrow (Wan's VAE has 96), as the other real presets' VAEs
            vae_dim_mult=(1, 2, 4, 4),  # space / 8
            vae_temporal_downsample=(False, True, True),  # time / 4, as Wan 2.1's VAE
        )
        if family == "wan":
            return build_tiny_wan(folder, sizes=sizes, transformer_config=WAN21_T2V_1_3B, device=device, dtype=dtype)
        config = WAN22_T2V_A14B_EXPERT
        return build_tiny_wan22(folder, sizes=sizes, transformer_config=config, device=device, dtype=dtype)
    sizes = TinyQwenImageSizes(latent_channels=16, text_hidden_size=3584, text_layers=1, vae_dim_mult=(1, 2, 4, 4))
    return build_tiny_qwen_image(folder, sizes=sizes, transformer_config=QWEN_IMAGE, device=device, dtype=dtype)
