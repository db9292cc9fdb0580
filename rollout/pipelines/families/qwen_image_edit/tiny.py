"""Tiny `QwenImageEditPipeline` and `QwenImageEditPlusPipeline`: Qwen-Image's components (see
families/qwen_image/tiny.py) plus a `Qwen2VLProcessor`, whose image processor makes a few vision tokens
of every input image, and a text encoder whose vision tower reads them.

Both pipelines resize an input image to about a megapixel before the VAE encodes it (their
`calculate_dimensions(1024 * 1024, ...)`), whatever its size, so the tiny VAE compresses by 16
(four downsamples of 8 channels): a megapixel is 1024 tokens beside a 32x32 output's one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rollout.pipelines.families.qwen_image.tiny import QWEN_IMAGE, TinyQwenImageSizes, build_tiny_qwen_image
from rollout.pipelines.tiny.builder import Preset, real_sizes
from rollout.pipelines.tiny.saving import InMemory
from rollout.pipelines.tiny.tokenizers import qwen25_vl_tokenizer

# A megapixel condition image becomes 32x32 latents; a 32x32 output, 2x2 latents (one packed token).
# Base dim 8: each upsampling conv of the decoder halves its feature channels (to 4 here), and the
# colour map (tiny/colour.py) needs 3 of them to carry latent channels 0-2 (red, green, blue) to the
# output; base dim 4 lost blue. Measured on CPU, a megapixel encode costs 1.3x base dim 4's.
TINY_EDIT_SIZES = TinyQwenImageSizes(vae_base_dim=8, vae_dim_mult=(1, 1, 1, 1, 1))
# The vision tower's inputs: 14-pixel patches merged 2x2 (Qwen2.5-VL's own), at most 4 merged tokens
# per image (Qwen-Image-Edit's processor allows 12.8 megapixels: thousands of tokens).
VISION_PATCH = 14
VISION_MERGE = 2
TINY_MAX_VISION_TOKENS = 4


def tiny_processor():
    """A `Qwen2VLImageTextProcessor` over `qwen25_vl_tokenizer()` that resizes every image to at most
    `TINY_MAX_VISION_TOKENS` merged vision tokens (no torchvision needed to make or save it)."""
    from transformers import Qwen2VLImageProcessorPil

    from rollout.pipelines.qwen_vl_processor import Qwen2VLImageTextProcessor

    merged = (VISION_PATCH * VISION_MERGE) ** 2
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": merged, "longest_edge": merged * TINY_MAX_VISION_TOKENS},
        patch_size=VISION_PATCH,
        merge_size=VISION_MERGE,
        temporal_patch_size=2,
    )
    return Qwen2VLImageTextProcessor(image_processor=image_processor, tokenizer=qwen25_vl_tokenizer())


def build_tiny_qwen_image_edit(path: str | Path, seed: int = 0, **kwargs) -> Path:
    """A tiny `QwenImageEditPipeline` (see `build_tiny_qwen_image`; `TINY_EDIT_SIZES` unless
    `sizes=` says)."""
    return _build_tiny_edit(path, seed, "QwenImageEditPipeline", **kwargs)


def build_tiny_qwen_image_edit_plus(path: str | Path, seed: int = 0, **kwargs) -> Path:
    """A tiny `QwenImageEditPlusPipeline` (several reference images; see `build_tiny_qwen_image_edit`)."""
    return _build_tiny_edit(path, seed, "QwenImageEditPlusPipeline", **kwargs)


def _build_tiny_edit(path: str | Path, seed: int, pipeline_class: str, **kwargs) -> Path:
    kwargs.setdefault("sizes", TINY_EDIT_SIZES)
    processor = tiny_processor()
    path = build_tiny_qwen_image(path, seed=seed, pipeline_class=pipeline_class, processor=processor, **kwargs)
    # The image processor's config also in its own file (preprocessor_config.json), as a downloaded
    # folder has it: where torchvision is installed, Qwen2VLProcessor.from_pretrained makes its video
    # processor from that file when the folder saved none.
    if not isinstance(path, InMemory):
        processor.image_processor.save_pretrained(path / "processor")
    return path


# Benchmark presets (benchmarks/model_presets.py), as in families/qwen_image/tiny.py.

# Qwen-Image-Edit's and Qwen-Image-Edit-2509's transformer/config.json: Qwen-Image's 20B MMDiT.
QWEN_IMAGE_EDIT = dict(QWEN_IMAGE)
QWEN_IMAGE_EDIT_2509 = dict(QWEN_IMAGE)
# Qwen-Image-Edit-2511's: the same, with `zero_cond_t` (the reference images' tokens modulated at
# timestep 0); no parameter changes.
QWEN_IMAGE_EDIT_2511 = {**QWEN_IMAGE, "zero_cond_t": True}

SMALL_SIZES = dataclasses.replace(
    TINY_EDIT_SIZES, num_layers=4, num_attention_heads=4, attention_head_dim=32, axes_dims_rope=(8, 12, 12)
)
# The real transformer's latents (16 channels) from a small VAE with the real scale factor (8), and
# the published pipelines' default sizes.
REAL_SIZES = real_sizes(
    TinyQwenImageSizes, latent_channels=16, text_hidden_size=3584, vae_base_dim=8, vae_dim_mult=(1, 1, 1, 1)
)
# A transformer big enough to dominate a CPU's time (4 layers of 4 x 32 heads), a tiny text encoder and
# VAE; the real ones: Qwen-Image-Edit's transformer (20B parameters), and Qwen-Image-Edit-2511's
# (`zero_cond_t`) under QwenImageEditPlusPipeline, with random weights, a one-layer text encoder of the
# real width, and a small VAE with the real scale factor and latent channels.
build_small_qwen_image_edit = Preset(build_tiny_qwen_image_edit, SMALL_SIZES)
build_small_qwen_image_edit_plus = Preset(build_tiny_qwen_image_edit_plus, SMALL_SIZES)
build_real_qwen_image_edit = Preset(build_tiny_qwen_image_edit, REAL_SIZES, QWEN_IMAGE_EDIT)
build_real_qwen_image_edit_plus = Preset(build_tiny_qwen_image_edit_plus, REAL_SIZES, QWEN_IMAGE_EDIT_2511)
