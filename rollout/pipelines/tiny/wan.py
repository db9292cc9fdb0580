"""Tiny `WanPipeline`s: Wan 2.1 (one transformer) and Wan 2.2 (a high-noise and a low-noise expert
split at a boundary), with a UMT5 encoder, a causal video VAE made colour-faithful, all random."""

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


def _build(path, seed, sizes, transformer_config, boundary_ratio, device, dtype) -> Path:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    tokenizer = t5_tokenizer()
    torch.manual_seed(seed)
    channels = sizes.latent_channels
    with torch.device(device):
        transformer = _transformer(sizes, transformer_config)
        transformer_2 = _transformer(sizes, transformer_config) if boundary_ratio is not None else None
        vae = AutoencoderKLWan(
            base_dim=sizes.vae_base_dim,
            z_dim=channels,
            dim_mult=list(sizes.vae_dim_mult),
            num_res_blocks=1,
            temperal_downsample=list(sizes.vae_temporal_downsample),
            latents_mean=[0.0] * channels,
            latents_std=[1.0] * channels,
            scale_factor_spatial=2 ** (len(sizes.vae_dim_mult) - 1),
            scale_factor_temporal=2 ** sum(sizes.vae_temporal_downsample),
        )
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
    )
    return save(pipeline, path, dtype)


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
