"""Tiny `WanPipeline`s: Wan 2.1 (one transformer) and Wan 2.2 (a high-noise and a low-noise expert
split at a boundary), with a UMT5 encoder, a causal video VAE made colour-faithful, all random; and
Wan 2.2 TI2V's layout (one timestep per latent token, a residual VAE that patchifies its input)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.quiet import quietly
from rollout.pipelines.sampling_defaults import SamplingDefaults
from rollout.pipelines.tiny.builder import Preset, published_config, tiny_builder
from rollout.pipelines.tiny.colour import make_causal_decoder_colour_faithful
from rollout.pipelines.tiny.saving import TINY_VIDEO, save
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
    sampling_defaults: SamplingDefaults | None = TINY_VIDEO  # an unsized request's (None: the pipeline's)


@tiny_builder(TinyWanSizes())
def build_tiny_wan(path, seed, sizes, transformer_config, device, dtype, boundary_ratio: float | None = None) -> Path:
    """A tiny Wan 2.1 `WanPipeline` (a `TinyBuilder`). A `boundary_ratio` makes it Wan 2.2's two
    experts, split there (`build_tiny_wan22`)."""
    return _build(path, seed, sizes, transformer_config, boundary_ratio, device, dtype)


def build_tiny_wan22(path: str | Path, seed: int = 0, **options) -> Path:
    """Build a Wan 2.2 `WanPipeline` with two experts (`transformer` for high noise, `transformer_2`
    for low noise, split at `boundary_ratio` 0.875) and save it to `path`; returns `path`. Takes
    `build_tiny_wan`'s options."""
    return build_tiny_wan(path, seed, boundary_ratio=WAN22_BOUNDARY_RATIO, **options)


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
        transformer = wan_transformer(sizes, transformer_config)
        transformer_2 = wan_transformer(sizes, transformer_config) if boundary_ratio is not None else None
        vae = wan_vae(sizes, residual=ti2v)
        if not ti2v:
            make_causal_decoder_colour_faithful(vae)
        text_encoder = umt5_encoder(tokenizer, sizes.text_hidden_size)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=WAN_SHIFT)
    experts = dict(transformer=transformer, transformer_2=transformer_2, boundary_ratio=boundary_ratio)
    text = dict(tokenizer=tokenizer, text_encoder=text_encoder)
    pipeline = WanPipeline(vae=vae, scheduler=scheduler, expand_timesteps=ti2v, **text, **experts)
    return save(pipeline, path, dtype, sizes.sampling_defaults)


def wan_vae(sizes: TinyWanSizes, residual: bool):
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


def wan_transformer(sizes: TinyWanSizes, config: dict | None):
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


# Benchmark presets (benchmarks/model_presets.py), as in families/sd3/tiny.py.

# Wan 2.1 T2V 1.3B and each of Wan 2.2 T2V A14B's two experts (diffusers' scripts/convert_wan_to_diffusers.py,
# "Wan-T2V-1.3B" and "Wan2.2-T2V-A14B"; the A14B's pipeline has boundary_ratio 0.875).
WAN21_T2V_1_3B = published_config(__file__, "wan21_t2v_1_3b.json")
WAN22_T2V_A14B_EXPERT = WAN21_T2V_1_3B | {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
# The small preset's Wan transformer (each expert of wan22): the tiny pipeline's latents (4 channels)
# and text width (32), 4 layers of 4 x 32 heads with a 4x MLP, as the other small presets; the rest
# (cross-attention norm, qk norm) as Wan 2.1 1.3B.
WAN_SMALL = WAN21_T2V_1_3B | {
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
# The real presets' VAE: space / 8 and time / 4, as Wan 2.1's, but narrow (Wan's has base_dim 96),
# as the other real presets' VAEs; text of umt5-xxl's width.
REAL_WAN_SIZES = TinyWanSizes(
    latent_channels=16,
    text_hidden_size=4096,
    vae_base_dim=24,
    vae_dim_mult=(1, 2, 4, 4),
    vae_temporal_downsample=(False, True, True),
    sampling_defaults=None,  # the published pipeline's default size and frames
)


# Wan 2.1 and 2.2 with `WAN_SMALL` transformers, a tiny text encoder and VAE.
build_small_wan = Preset(build_tiny_wan, None, WAN_SMALL)
build_small_wan22 = Preset(build_tiny_wan22, None, WAN_SMALL)
# Wan 2.1 T2V 1.3B's transformer (1.4B parameters) and Wan 2.2 T2V A14B's two experts (14.3B parameters
# each) with random weights, a one-layer UMT5 of the real width, and a narrow VAE with the real scale
# factors and latent channels.
build_real_wan = Preset(build_tiny_wan, REAL_WAN_SIZES, WAN21_T2V_1_3B)
build_real_wan22 = Preset(build_tiny_wan22, REAL_WAN_SIZES, WAN22_T2V_A14B_EXPERT)
