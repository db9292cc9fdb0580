"""Tiny `HunyuanVideo15Pipeline`s (text-to-video) and `HunyuanVideo15ImageToVideoPipeline`s
(image-to-video) of the real classes with random weights: a two-layer Qwen2.5-VL text model over
the byte-level Qwen2 tokenizer, a one-layer T5 over ByT5's own tokenizer (glyph text), the causal
DC-AE-style video VAE, the dual-stream transformer, the pipeline's `ClassifierFreeGuidance` guider
and, for image-to-video, a one-layer SigLIP vision encoder and its image processor; plus their
benchmark presets (`small`, and `real`: HunyuanVideo 1.5 480p's transformer)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.sampling_defaults import SamplingDefaults
from rollout.pipelines.tiny.builder import Preset, published_config, small_sizes, tiny_builder
from rollout.pipelines.tiny.colour import make_dcae_video_decoder_colour_faithful
from rollout.pipelines.tiny.saving import TINY_FRAMES, save
from rollout.pipelines.tiny.text_encoders import t5_encoder, text_model_sizes
from rollout.pipelines.tiny.tokenizers import content_list_tokenizer

# HunyuanVideo 1.5 480p's scheduler shift and guidance (diffusers' scripts/
# convert_hunyuan_video1_5_to_diffusers.py, SCHEDULER_CONFIGS and GUIDANCE_CONFIGS for 480p_t2v
# and 480p_i2v: shift 5.0, guidance_scale 6.0; 720p: shift 9.0 (t2v) and 7.0 (i2v)).
HUNYUAN15_SHIFT = 5.0
HUNYUAN15_GUIDANCE = 6.0


@dataclass(frozen=True)
class TinyHunyuanVideo15Sizes:
    """Sizes of the tiny pipeline: 32x32 frames from 8x8x4 latents (the VAE divides space by 4 and
    time by 2 after the first frame: 9 frames are 5 latent frames), one token per latent pixel;
    `target_size` 32 makes the pipeline's default (and an image-to-video request's) size a bucket
    of about 32x32 pixels."""

    latent_channels: int = 4
    num_layers: int = 1
    num_refiner_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    text_hidden_size: int = 32
    text_layers: int = 2  # the pipeline reads the third hidden state from the end
    glyph_hidden_size: int = 32
    vision_hidden_size: int = 32
    target_size: int = 32
    vae_block_out_channels: tuple[int, ...] = (8, 16, 16)
    vae_spatial: int = 4
    vae_temporal: int = 2
    sampling_defaults: SamplingDefaults | None = TINY_FRAMES  # frames only: its size is target_size's


TINY_SIZES = TinyHunyuanVideo15Sizes()


def hunyuan_transformer_config(sizes: TinyHunyuanVideo15Sizes) -> dict:
    """The tiny transformer: the noisy latents, the first frame's latents and its mask in (2C + 1
    channels), the noisy latents' velocity out; rotary axes of a quarter of each head for time and
    the rest split between height and width (each even, as the rotary table needs)."""
    head = sizes.attention_head_dim
    time = head // 4
    return {
        "in_channels": 2 * sizes.latent_channels + 1,
        "out_channels": sizes.latent_channels,
        "num_attention_heads": sizes.num_attention_heads,
        "attention_head_dim": head,
        "num_layers": sizes.num_layers,
        "num_refiner_layers": sizes.num_refiner_layers,
        "patch_size": 1,
        "patch_size_t": 1,
        "text_embed_dim": sizes.text_hidden_size,
        "text_embed_2_dim": sizes.glyph_hidden_size,
        "image_embed_dim": sizes.vision_hidden_size,
        "rope_axes_dim": (time, (head - time) // 2, (head - time) // 2),
        "target_size": sizes.target_size,
    }


@tiny_builder(TINY_SIZES)
def build_tiny_hunyuan_video15(
    path, seed, sizes, transformer_config, device, dtype, image_to_video: bool = False
) -> Path:
    """A tiny `HunyuanVideo15Pipeline` (a `TinyBuilder`; with `image_to_video`, a
    `HunyuanVideo15ImageToVideoPipeline`)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer

    tokenizer, tokenizer_2 = content_list_tokenizer(), ByT5Tokenizer()
    config = transformer_config or hunyuan_transformer_config(sizes)
    torch.manual_seed(seed)
    with torch.device(device):
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=sizes.latent_channels,
            block_out_channels=sizes.vae_block_out_channels,
            layers_per_block=1,
            spatial_compression_ratio=sizes.vae_spatial,
            temporal_compression_ratio=sizes.vae_temporal,
        )
        make_dcae_video_decoder_colour_faithful(vae)
        components = {
            "transformer": HunyuanVideo15Transformer3DModel(**config),
            "vae": vae,
            "text_encoder": _qwen25_vl_text_model(tokenizer, config["text_embed_dim"], sizes.text_layers),
            "text_encoder_2": t5_encoder(tokenizer_2, config["text_embed_2_dim"]),
        }
        if image_to_video:
            components["image_encoder"] = _siglip_vision_encoder(config["image_embed_dim"])
    components |= {
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=HUNYUAN15_SHIFT),
        "guider": ClassifierFreeGuidance(guidance_scale=HUNYUAN15_GUIDANCE),
    }
    if image_to_video:
        components["feature_extractor"] = _siglip_image_processor()
        pipeline = HunyuanVideo15ImageToVideoPipeline(**components)
    else:
        pipeline = HunyuanVideo15Pipeline(**components)
    return save(pipeline, path, dtype, sizes.sampling_defaults)


def build_tiny_hunyuan_video15_i2v(path: str | Path, seed: int = 0, **options) -> Path:
    """Build a `HunyuanVideo15ImageToVideoPipeline` (`build_tiny_hunyuan_video15`'s, with a SigLIP
    vision encoder of the transformer's image width); returns `path`."""
    return build_tiny_hunyuan_video15(path, seed, image_to_video=True, **options)


def _qwen25_vl_text_model(tokenizer, width: int, layers: int):
    """Qwen2.5-VL's language model alone (`Qwen2_5_VLTextModel`, what the pipeline loads as its
    text encoder), `width` wide with `layers` layers."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    heads = max(2, width // 128)
    rotary_half = width // heads // 2  # multimodal RoPE splits each head's rotary half in 3 sections
    sections = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    config = Qwen2_5_VLTextConfig(
        **text_model_sizes(tokenizer, width, layers),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        rope_scaling={"mrope_section": sections, "rope_type": "default", "type": "default"},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.pad_token_id,
    )
    return Qwen2_5_VLTextModel(config)


def _siglip_vision_encoder(width: int):
    """SigLIP's vision tower `width` wide (the transformer's image_embed_dim), one layer, 32x32 images
    in 8x8 patches: 16 tokens (HunyuanVideo 1.5's SigLIP at 384: 729 tokens of 1152)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=1,
        num_attention_heads=max(2, width // 72),  # SigLIP so400m: 16 heads of 72
        image_size=32,
        patch_size=8,
    )
    return SiglipVisionModel(config).eval()


def _siglip_image_processor():
    """SigLIP's image processor (its mean and std 0.5) at the tiny encoder's 32x32."""
    from transformers import SiglipImageProcessor

    return SiglipImageProcessor(size={"height": 32, "width": 32})


# Benchmark presets (benchmarks/model_presets.py), as in families/wan/tiny.py.

# HunyuanVideo 1.5 480p's transformer (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py,
# "480p_t2v" and "480p_i2v", converted to hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v and _i2v;
# HunyuanVideo15Transformer3DModel's defaults): 54 dual-stream blocks of 16 heads of 128, Qwen2.5-VL
# 7B's 3584-wide text, ByT5's 1472-wide glyph text, SigLIP's 1152-wide image tokens, 32 latent
# channels (65 in: the noisy latents, the first frame's and its mask), target size 640.
HUNYUAN15_480P = published_config(__file__, "hunyuan15_480p.json")
# The small preset's transformer: the tiny pipeline's latents, text and image widths, 4 layers of
# 4 x 32 heads (as the other small presets).
SMALL_SIZES = small_sizes(TinyHunyuanVideo15Sizes, num_refiner_layers=2)
# The real presets' VAE: space / 16 and time / 4 with 32 latent channels, as HunyuanVideo 1.5's,
# but narrow (its widths are 128..1024), as the other real presets' VAEs; text at the real widths.
REAL_SIZES = TinyHunyuanVideo15Sizes(
    latent_channels=32,
    text_hidden_size=3584,
    glyph_hidden_size=1472,
    vision_hidden_size=1152,
    target_size=640,
    vae_block_out_channels=(32, 32, 64, 64, 64),
    vae_spatial=16,
    vae_temporal=4,
    sampling_defaults=None,  # the published pipeline's frames
)


# Text- and image-to-video with the small transformer, tiny text (and image) encoders and VAE.
build_small_hunyuan_video15 = Preset(build_tiny_hunyuan_video15, None, hunyuan_transformer_config(SMALL_SIZES))
build_small_hunyuan_video15_i2v = Preset(build_tiny_hunyuan_video15_i2v, None, hunyuan_transformer_config(SMALL_SIZES))
# HunyuanVideo 1.5 480p's transformer (`HUNYUAN15_480P`, 8.3B parameters) with random weights, two-layer
# text encoders of the real widths, and a narrow VAE with the real scale factors; for image-to-video
# also a one-layer SigLIP of the real width.
build_real_hunyuan_video15 = Preset(build_tiny_hunyuan_video15, REAL_SIZES, HUNYUAN15_480P)
build_real_hunyuan_video15_i2v = Preset(build_tiny_hunyuan_video15_i2v, REAL_SIZES, HUNYUAN15_480P)
