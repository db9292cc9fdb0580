"""Tiny `WanImageToVideoPipeline`s: Wan 2.1 I2V (one transformer that reads CLIP image embeddings,
with a CLIP vision encoder) and Wan 2.2 I2V A14B (two experts split at 0.9, no image encoder), with
Wan's tiny UMT5 encoder and causal VAE (`families/wan/tiny.py`), all random; plus their benchmark presets."""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.pipelines.families.wan.tiny import REAL_WAN_SIZES, WAN21_T2V_1_3B, WAN_SHIFT, TinyWanSizes, wan_vae
from rollout.pipelines.tiny.builder import Preset, tiny_builder
from rollout.pipelines.tiny.colour import make_causal_decoder_colour_faithful
from rollout.pipelines.tiny.saving import save
from rollout.pipelines.tiny.text_encoders import umt5_encoder
from rollout.pipelines.tiny.tokenizers import t5_tokenizer

# Wan 2.2 I2V A14B's boundary (the Wan2.2 repository's wan/configs/wan_i2v_A14B.py: boundary 0.900;
# its T2V's is 0.875): steps with timestep >= 900 go to the high-noise expert.
WAN22_I2V_BOUNDARY_RATIO = 0.9
TINY_CLIP_WIDTH = 32  # the tiny CLIP vision encoder's width: the tiny transformer's image_dim
TINY_SIZES = TinyWanSizes()


def i2v_transformer_config(sizes: TinyWanSizes, temporal_scale: int, image_dim: int | None) -> dict:
    """The tiny I2V transformer: the tiny T2V one whose input adds the first frame's mask (one
    channel per frame of the VAE's temporal scale) and latents; with `image_dim`, Wan 2.1's added
    key/value projections of the CLIP image embeddings."""
    channels = sizes.latent_channels
    width = sizes.num_attention_heads * sizes.attention_head_dim
    image = {} if image_dim is None else {"image_dim": image_dim, "added_kv_proj_dim": width}
    return {
        "patch_size": (1, 2, 2),
        "num_attention_heads": sizes.num_attention_heads,
        "attention_head_dim": sizes.attention_head_dim,
        "in_channels": 2 * channels + temporal_scale,
        "out_channels": channels,
        "text_dim": sizes.text_hidden_size,
        "freq_dim": 32,
        "ffn_dim": 2 * width,
        "num_layers": sizes.num_layers,
        "rope_max_seq_len": 64,
        **image,
    }


@tiny_builder(TINY_SIZES)
def build_tiny_wan_i2v(
    path, seed, sizes, transformer_config, device, dtype, boundary_ratio: float | None = None
) -> Path:
    """A tiny Wan 2.1 I2V `WanImageToVideoPipeline` (a `TinyBuilder`: a tiny CLIP vision encoder of
    32x32 images, its image processor, a transformer with `image_dim`). A `boundary_ratio` makes it
    Wan 2.2 I2V's two experts without an image encoder (`build_tiny_wan22_i2v`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from diffusers.models import WanTransformer3DModel

    tokenizer = t5_tokenizer()
    two_experts = boundary_ratio is not None
    torch.manual_seed(seed)
    with torch.device(device):
        vae = wan_vae(sizes, residual=False)
        make_causal_decoder_colour_faithful(vae)
        temporal = vae.config.scale_factor_temporal
        image_dim = None if two_experts else TINY_CLIP_WIDTH
        config = transformer_config or i2v_transformer_config(sizes, temporal, image_dim)
        transformer = WanTransformer3DModel(**config)
        transformer_2 = WanTransformer3DModel(**config) if two_experts else None
        text_encoder = umt5_encoder(tokenizer, sizes.text_hidden_size)
        clip_width = config.get("image_dim")  # Wan 2.1's CLIP width; None: no image encoder (Wan 2.2)
        image_encoder = None if clip_width is None else _clip_vision_encoder(clip_width)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=WAN_SHIFT)
    image = dict(
        image_processor=None if image_encoder is None else _clip_image_processor(), image_encoder=image_encoder
    )
    experts = dict(transformer=transformer, transformer_2=transformer_2, boundary_ratio=boundary_ratio)
    pipeline = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, **image, **experts
    )
    return save(pipeline, path, dtype, sizes.sampling_defaults)


def build_tiny_wan22_i2v(path: str | Path, seed: int = 0, **options) -> Path:
    """Build a Wan 2.2 I2V A14B-style `WanImageToVideoPipeline`: two experts split at boundary 0.9,
    no image encoder; returns `path`. Takes `build_tiny_wan_i2v`'s options."""
    return build_tiny_wan_i2v(path, seed, boundary_ratio=WAN22_I2V_BOUNDARY_RATIO, **options)


def _clip_vision_encoder(width: int):
    """CLIP's vision tower of `width` (the transformer's image_dim) at 32x32, two layers (4x4 patches
    of 8): the pipeline reads its penultimate hidden states, 17 tokens (Wan 2.1's ViT-H/14 at 224:
    257 tokens of 1280)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=max(2, width // 80),  # ViT-H: 16 heads of 80
        image_size=32,
        patch_size=8,
        projection_dim=width,
    )
    return CLIPVisionModel(config).eval()


def _clip_image_processor():
    """CLIP's image processor (OpenAI's mean and std, as Wan 2.1 I2V's) at the tiny encoder's 32x32."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


# Benchmark presets (benchmarks/model_presets.py), as in families/wan/tiny.py.

# Wan 2.1 I2V 14B 480P's transformer (diffusers' scripts/convert_wan_to_diffusers.py, "Wan-I2V-14B-480p",
# converted to Wan-AI/Wan2.1-I2V-14B-480P-Diffusers): Wan 2.1 T2V 14B's shape (40 heads of 128, a
# 13824 MLP, 40 layers) with 36 input channels (16 noisy latents + 4 mask + 16 first-frame latents)
# and CLIP ViT-H's 1280-wide image embeddings read through added key/value projections of 5120.
WAN21_I2V_14B = WAN21_T2V_1_3B | {
    "num_attention_heads": 40,
    "ffn_dim": 13824,
    "num_layers": 40,
    "in_channels": 36,
    "image_dim": 1280,
    "added_kv_proj_dim": 5120,
}
# Each of Wan 2.2 I2V A14B's experts (the same script's "Wan2.2-I2V-14B-720p", Wan-AI/Wan2.2-I2V-A14B):
# the same with no image embeddings.
WAN22_I2V_A14B_EXPERT = WAN21_I2V_14B | {"image_dim": None, "added_kv_proj_dim": None}


# The small preset's transformer: families/wan/tiny.py's WAN_SMALL (4 layers of 4 x 32 heads, a 512 MLP, Wan
# 2.1 1.3B's norms) taking the tiny VAE's first frame (4 + 2 + 4 input channels) and, for Wan 2.1,
# the tiny CLIP's embeddings.
def _small_config(image_dim: int | None) -> dict:
    sizes = TinyWanSizes(num_attention_heads=4, attention_head_dim=32, num_layers=4)
    norms = {"cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6}
    return i2v_transformer_config(sizes, 2, image_dim) | {"ffn_dim": 512} | norms


# Wan 2.1 I2V with the small transformer, a tiny text encoder, CLIP and VAE; Wan 2.2 I2V with two small
# experts, a tiny text encoder and VAE.
build_small_wan_i2v = Preset(build_tiny_wan_i2v, None, _small_config(TINY_CLIP_WIDTH))
build_small_wan22_i2v = Preset(build_tiny_wan22_i2v, None, _small_config(None))
# Wan 2.1 I2V 14B 480P's transformer (`WAN21_I2V_14B`) and Wan 2.2 I2V A14B's two experts
# (`WAN22_I2V_A14B_EXPERT`) with random weights, a one-layer UMT5 of the real width, a narrow VAE with
# the real scale factors, and (Wan 2.1) a two-layer CLIP vision encoder of ViT-H's width (1280, the
# transformer's image_dim) at 32x32.
build_real_wan_i2v = Preset(build_tiny_wan_i2v, REAL_WAN_SIZES, WAN21_I2V_14B)
build_real_wan22_i2v = Preset(build_tiny_wan22_i2v, REAL_WAN_SIZES, WAN22_I2V_A14B_EXPERT)
