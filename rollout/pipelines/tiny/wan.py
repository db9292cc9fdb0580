"""Tiny `WanPipeline`s: Wan 2.1 (one transformer) and Wan 2.2 (a high-noise and a low-noise expert
split at a boundary), with a UMT5 encoder, a causal video VAE made colour-faithful, all random; and
Wan 2.2 TI2V's layout (one timestep per latent token, a residual VAE that patchifies its input)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.quiet import quietly
from rollout.pipelines.tiny.colour import make_causal_decoder_colour_faithful
from rollout.pipelines.tiny.saving import save
from rollout.pipelines.tiny.text_encoders import umt5_encoder
from rollout.pipelines.tiny.tokenizers import t5_tokenizer

# Wan's flow-matching shift for 480p (the published recipes use 3.0 there, 5.0 at 720p).
WAN_SHIFT = 3.0
# Wan 2.2 A14B's boundary: steps with timestep >= 875 go to the high-noise expert.
WAN22_BOUNDARY_RATIO = 0.875


@dataclass(frozen=True)
class TinyWanSizes:
    """Sizes of the tiny pipeline: 32x32 frames from 16x16x4 latents (the VAE halves space and
    time: 9 frames are 5 latent frames), in 2x2 patches of 8 tokens per latent frame row."""

    latent_channels: int = 4
    num_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    text_hidden_size: int = 32
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2)  # one down/up sample: space / 2
    vae_temporal_downsample: tuple[bool, ...] = (True,)  # and time / 2 (after the first frame)


@quietly
def build_tiny_wan(
    path: str | Path,
    seed: int = 0,
    sizes: TinyWanSizes = TinyWanSizes(),
    transformer_config: dict | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Build a Wan 2.1 `WanPipeline` with random weights and save it to `path`; returns `path`.
    Deterministic in `seed`; `transformer_config` replaces the tiny transformer (benchmarks pass a
    published config); the modules are made on `device` and saved in `dtype`."""
    return _build(Path(path), seed, sizes, transformer_config, None, device, dtype)


@quietly
def build_tiny_wan22(
    path: str | Path,
    seed: int = 0,
    sizes: TinyWanSizes = TinyWanSizes(),
    transformer_config: dict | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Build a Wan 2.2 `WanPipeline` with two experts (`transformer` for high noise, `transformer_2`
    for low noise, split at `boundary_ratio` 0.875) and save it to `path`; returns `path`."""
    return _build(Path(path), seed, sizes, transformer_config, WAN22_BOUNDARY_RATIO, device, dtype)


# Wan 2.2 TI2V's sizes, shrunk: its residual VAE patchifies 2x2 pixels (12 input channels) before
# one spatial and temporal down block, so 32x32 x 9 frames become 8x8 x 5 latents of 8 channels.
TI2V_SIZES = TinyWanSizes(latent_channels=8, vae_dim_mult=(2, 2), vae_temporal_downsample=(True,))


@quietly
def build_tiny_wan22_ti2v(
    path: str | Path, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Path:
    """Build a `WanPipeline` in Wan 2.2 TI2V-5B's layout (`expand_timesteps`: the transformer takes
    one timestep per latent token; the VAE is the residual, patchifying one) and save it to `path`.
    Its decoder is random, not colour-faithful: for the TI2V code path, not for colour rewards."""
    return _build(Path(path), seed, TI2V_SIZES, None, None, device, dtype, ti2v=True)


def _build(path, seed, sizes, transformer_config, boundary_ratio, device, dtype, ti2v=False) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    tokenizer = t5_tokenizer()
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = _transformer(sizes, transformer_config)
        transformer_2 = _transformer(sizes, transformer_config) if boundary_ratio is not None else None
        vae = _vae(sizes, residual=ti2v)
        if not ti2v:
            make_causal_decoder_colour_faithful(vae)
        text_encoder = umt5_encoder(tokenizer, sizes.text_hidden_size)
    pipeline = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        transformer_2=transformer_2,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=WAN_SHIFT),
        boundary_ratio=boundary_ratio,
        expand_timesteps=ti2v,
    )
    return save(pipeline, path, dtype)


def _vae(sizes: TinyWanSizes, residual: bool):
    """Wan's causal VAE; `residual`: Wan 2.2's, with residual down/up blocks and 2x2 patches."""
    from diffusers import AutoencoderKLWan

    channels = sizes.latent_channels
    patch = 2 if residual else 1
    # Every block but the last halves space; the patches halve it once more.
    spatial = 2 ** (len(sizes.vae_dim_mult) - 1) * patch
    layout = {"is_residual": True, "patch_size": patch, "in_channels": 12, "out_channels": 12} if residual else {}
    return AutoencoderKLWan(
        base_dim=sizes.vae_base_dim,
        z_dim=channels,
        dim_mult=list(sizes.vae_dim_mult),
        num_res_blocks=1,
        temperal_downsample=list(sizes.vae_temporal_downsample),
        latents_mean=[0.0] * channels,
        latents_std=[1.0] * channels,
        scale_factor_spatial=spatial,
        scale_factor_temporal=2 ** sum(sizes.vae_temporal_downsample),
        **layout,
    )


def _transformer(sizes: TinyWanSizes, config: dict | None):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        **config
        or {
            "patch_size": (1, 2, 2),
            "num_attention_heads": sizes.num_attention_heads,
            "attention_head_dim": sizes.attention_head_dim,
            "in_channels": sizes.latent_channels,
            "out_channels": sizes.latent_channels,
            "text_dim": sizes.text_hidden_size,
            "freq_dim": 32,
            "ffn_dim": 2 * sizes.num_attention_heads * sizes.attention_head_dim,
            "num_layers": sizes.num_layers,
            "rope_max_seq_len": 64,
        }
    )
