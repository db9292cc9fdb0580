"""A tiny `QwenImagePipeline`: a Qwen2.5-VL text encoder, the dual-stream transformer, the causal
3D VAE (colour-faithful), all random, with Qwen-Image's own scheduler settings. The edit pipelines
(`QwenImageEditPipeline`, `QwenImageEditPlusPipeline`) add a processor: families/qwen_image_edit/tiny.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.sampling_defaults import SamplingDefaults
from rollout.pipelines.tiny.builder import Preset, block_sizes, published_config, real_sizes, small_sizes, tiny_builder
from rollout.pipelines.tiny.colour import make_causal_decoder_colour_faithful
from rollout.pipelines.tiny.saving import TINY_IMAGE, save
from rollout.pipelines.tiny.text_encoders import qwen25_vl_encoder
from rollout.pipelines.tiny.tokenizers import qwen2_tokenizer

# Qwen-Image's scheduler_config.json: exponential dynamic shift, stretched to end at sigma 0.02.
QWEN_IMAGE_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


@dataclass(frozen=True)
class TinyQwenImageSizes:
    """Sizes of the tiny pipeline: 32x32 images from 16x16x4 latents, packed into 64 tokens of 16."""

    latent_channels: int = 4
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)  # sums to attention_head_dim
    text_hidden_size: int = 32
    text_layers: int = 2
    vae_base_dim: int = 24
    vae_dim_mult: tuple[int, ...] = (1, 2)  # one spatial upsample per step after the first: scales by 2
    sampling_defaults: SamplingDefaults | None = TINY_IMAGE  # an unsized request's (None: the pipeline's)


@tiny_builder(TinyQwenImageSizes())
def build_tiny_qwen_image(
    path, seed, sizes, transformer_config, device, dtype, pipeline_class: str = "QwenImagePipeline", processor=None
) -> Path:
    """A tiny `QwenImagePipeline` (a `TinyBuilder`). An edit `pipeline_class` takes a
    `processor` (a `Qwen2VLProcessor`), whose tokenizer the pipeline and its text encoder share."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    tokenizer = qwen2_tokenizer() if processor is None else processor.tokenizer
    torch.manual_seed(seed)
    channels = sizes.latent_channels
    with torch.device(device):
        transformer = QwenImageTransformer2DModel(
            **transformer_config
            or {
                "patch_size": 2,
                "in_channels": 4 * channels,  # packed 2x2 patches
                "out_channels": channels,
                **block_sizes(sizes),
                "joint_attention_dim": sizes.text_hidden_size,
                "axes_dims_rope": sizes.axes_dims_rope,
            }
        )
        vae = AutoencoderKLQwenImage(
            base_dim=sizes.vae_base_dim,
            z_dim=channels,
            dim_mult=list(sizes.vae_dim_mult),
            num_res_blocks=1,
            temperal_downsample=[False] * (len(sizes.vae_dim_mult) - 1),  # images: no time axis to reduce
            latents_mean=[0.0] * channels,
            latents_std=[1.0] * channels,
        )
        make_causal_decoder_colour_faithful(vae)
        text_encoder = qwen25_vl_encoder(
            tokenizer, sizes.text_hidden_size, sizes.text_layers, reads_images=processor is not None
        )
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    text = dict(text_encoder=text_encoder, tokenizer=tokenizer) | (
        {} if processor is None else {"processor": processor}
    )
    pipeline = getattr(diffusers, pipeline_class)(scheduler=scheduler, vae=vae, transformer=transformer, **text)
    if processor is not None:  # model_index.json names the class whose files the folder holds, as
        # a downloaded folder does, whatever subclass made them (qwen_vl_processor.py)
        pipeline.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    return save(pipeline, path, dtype, sizes.sampling_defaults)


# Benchmark presets (benchmarks/model_presets.py), as in families/sd3/tiny.py.

# Qwen-Image's transformer/config.json.
QWEN_IMAGE = published_config(__file__, "qwen_image.json")


build_small_qwen_image = Preset(build_tiny_qwen_image, small_sizes(TinyQwenImageSizes, axes_dims_rope=(8, 12, 12)))
# Qwen-Image's transformer (20B parameters) with random weights, a one-layer text encoder of the real
# width, and a small VAE with the real scale factor and latent channels.
REAL_SIZES = real_sizes(TinyQwenImageSizes, latent_channels=16, text_hidden_size=3584, vae_dim_mult=(1, 2, 4, 4))
build_real_qwen_image = Preset(build_tiny_qwen_image, REAL_SIZES, QWEN_IMAGE)
