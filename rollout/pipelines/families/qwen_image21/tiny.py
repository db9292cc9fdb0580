"""A tiny `QwenImage21Pipeline`: a Qwen3-VL text encoder, the single-stream block-causal transformer
and Qwen-Image 2.1's VAE (16x spatial compression, latents read unpatched), all random, with a
`Qwen3VLProcessor` written locally. Qwen-Image 2.1's published scheduler settings are not in
diffusers, so the tiny folder takes Qwen-Image's (families/qwen_image/tiny.py) and no `sample_sigmas`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER, TinyQwenImageSizes
from rollout.pipelines.tiny.builder import Preset, block_sizes, published_config, real_sizes, small_sizes, tiny_builder
from rollout.pipelines.tiny.colour import (
    add_identity,
    paint_colours,
    pass_latents_through_causal_resnets,
    quiet_causal_attention,
)
from rollout.pipelines.tiny.saving import save
from rollout.pipelines.tiny.text_encoders import TINY_VISION_TOWER, text_model_sizes, vision_markers
from rollout.pipelines.tiny.tokenizers import CONTENT_LIST_CHAT_TEMPLATE, QWEN_VISION_TOKENS, qwen25_vl_tokenizer


@dataclass(frozen=True)
class TinyQwenImage21Sizes(TinyQwenImageSizes):
    """Sizes of the tiny pipeline: 32x32 images from 2x2x4 latents (4 tokens, one encoder slot).
    Qwen-Image's tiny transformer and text encoder, with a VAE that downsamples 16x."""

    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 1, 1, 1, 1)  # four spatial downsamples: 16x, as the pipeline assumes


def tiny_qwen3_vl_processor():
    """A `Qwen3VLProcessor` (without torchvision: its image-and-text subclass) over a byte-level
    tokenizer with Qwen's chat and vision markers. The pipeline applies its chat template once, to
    the system message, whose token count is the number of hidden states it drops (`_drop_idx`)."""
    from transformers import Qwen2VLImageProcessorPil

    from rollout.pipelines.qwen_vl_processor import Qwen3VLImageTextProcessor

    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLImageTextProcessor(
        image_processor=image_processor, tokenizer=qwen25_vl_tokenizer(), chat_template=CONTENT_LIST_CHAT_TEMPLATE
    )


def qwen3_vl_encoder(tokenizer, width: int, layers: int):
    """A `Qwen3VLForConditionalGeneration` with a `width`-wide language model of `layers` layers and
    a one-block vision tower, its vision markers the tokenizer's own."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    heads = max(2, width // 128)
    rotary_half = width // heads // 2  # interleaved multimodal RoPE: 3 sections of each head's half
    sections = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    markers = tokenizer.convert_tokens_to_ids(list(QWEN_VISION_TOKENS))  # start, end, image, video
    config = Qwen3VLConfig(
        text_config={
            **text_model_sizes(tokenizer, width, layers),
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": width // heads,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": sections, "mrope_interleaved": True},
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config=TINY_VISION_TOWER
        | {"out_hidden_size": width, "deepstack_visual_indexes": [0], "num_position_embeddings": 64},
        **vision_markers(markers),
    )
    return Qwen3VLForConditionalGeneration(config)


@torch.no_grad()
def make_qwen_image21_decoder_colour_faithful(vae) -> None:
    """As `colour.make_causal_decoder_colour_faithful`, for Qwen-Image 2.1's decoder (2D convs in a
    causal-3D shell, residual up blocks): latent channel c paints colour c."""
    decoder = vae.decoder
    latent_channels = pass_latents_through_causal_resnets(vae, torch.nn.Conv2d)
    for block in decoder.up_blocks:
        if block.upsampler is not None:
            conv = block.upsampler.resample[1]  # after the nearest-neighbour upsample
            add_identity(conv, conv.out_channels)
    quiet_causal_attention(decoder)
    paint_colours(decoder.conv_out, latent_channels)


@tiny_builder(TinyQwenImage21Sizes())
def build_tiny_qwen_image21(path, seed, sizes, transformer_config, device, dtype) -> Path:
    """A tiny `QwenImage21Pipeline` (a `TinyBuilder`)."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )

    processor = tiny_qwen3_vl_processor()
    torch.manual_seed(seed)
    channels = sizes.latent_channels
    with torch.device(device):
        transformer = QwenImage21Transformer2DModel(
            **transformer_config
            or {
                "in_channels": channels,
                "out_channels": channels,
                **block_sizes(sizes),
                "context_in_dim": sizes.text_hidden_size,
                "axes_dims_rope": sizes.axes_dims_rope,
            }
        )
        vae = AutoencoderKLQwenImage21(
            base_dim=sizes.vae_base_dim,
            decoder_base_dim=sizes.vae_base_dim,
            z_dim=channels,
            dim_mult=list(sizes.vae_dim_mult),
            num_res_blocks=1,
            temperal_downsample=[False] * (len(sizes.vae_dim_mult) - 1),
            latents_mean=[0.0] * channels,
            latents_std=[1.0] * channels,
            in_channels=4,  # RGBA, as the pipeline's condition images reach the VAE
            out_channels=3,
        )
        make_qwen_image21_decoder_colour_faithful(vae)
        text_encoder = qwen3_vl_encoder(processor.tokenizer, sizes.text_hidden_size, sizes.text_layers)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    text = dict(text_encoder=text_encoder, processor=processor)
    pipeline = QwenImage21Pipeline(scheduler=scheduler, vae=vae, transformer=transformer, **text)
    # model_index.json names the class whose files the folder holds (qwen_vl_processor.py)
    pipeline.register_to_config(processor=("transformers", "Qwen3VLProcessor"))
    return save(pipeline, path, dtype, sizes.sampling_defaults)


# Benchmark presets (benchmarks/model_presets.py), as in families/qwen_image/tiny.py.

# Qwen-Image 2.1's transformer: QwenImage21Transformer2DModel's defaults in diffusers 0.42.1, which
# its docstring gives as the published model's (32 single-stream blocks of 32 x 128 heads, Qwen3-VL's
# 4096-wide hidden states, 64 latent channels read unpatched); the checkpoint's own config.json is
# not available offline to compare.
QWEN_IMAGE21 = published_config(__file__, "qwen_image21.json")


SMALL_SIZES = small_sizes(TinyQwenImage21Sizes, axes_dims_rope=(8, 12, 12))
build_small_qwen_image21 = Preset(build_tiny_qwen_image21, SMALL_SIZES)
# Qwen-Image 2.1's transformer with random weights, a one-layer text encoder of the real width, and a
# small VAE with the real latent channels and scale factor.
REAL_SIZES = real_sizes(TinyQwenImage21Sizes, latent_channels=64, text_hidden_size=4096, vae_base_dim=64)
build_real_qwen_image21 = Preset(build_tiny_qwen_image21, REAL_SIZES, QWEN_IMAGE21)
