"""Tiny pipelines of every supported family, of the real diffusers/transformers classes, with
random weights.

Tests, demos and benchmarks cannot download weights, so they build a pipeline here, save it with
`save_pretrained`, and load it back with the real `from_pretrained` code; every folder loads with
plain `PipelineClass.from_pretrained(path)`. Tokenizers are written locally (`tokenizers.py`), and
the VAE decoders are set close to a colour map (`colour.py`), so an image's colours follow its
latents and the demos' colour reward is something a policy can learn.

    python -m rollout.pipelines.tiny OUT_DIR [--family NAME] [--seed N]   (--help lists the families)
"""

from __future__ import annotations

import argparse
import logging

from rollout.pipelines.families import FAMILIES, families_help
from rollout.pipelines.tiny.flux import TinyFluxSizes, build_tiny_flux, build_tiny_flux_kontext
from rollout.pipelines.tiny.flux2 import TinyFlux2KleinSizes, build_tiny_flux2_dev, build_tiny_flux2_klein
from rollout.pipelines.tiny.hunyuan_video15 import (
    TinyHunyuanVideo15Sizes,
    build_tiny_hunyuan_video15,
    build_tiny_hunyuan_video15_i2v,
)
from rollout.pipelines.tiny.ltx2 import TinyLTX2Sizes, build_tiny_ltx2, build_tiny_ltx2_i2v
from rollout.pipelines.tiny.qwen_image import TinyQwenImageSizes, build_tiny_qwen_image
from rollout.pipelines.tiny.qwen_image21 import TinyQwenImage21Sizes, build_tiny_qwen_image21
from rollout.pipelines.tiny.qwen_image_edit import build_tiny_qwen_image_edit, build_tiny_qwen_image_edit_plus
from rollout.pipelines.tiny.sd3 import TinySD3Sizes, build_tiny_sd3
from rollout.pipelines.tiny.wan import TinyWanSizes, build_tiny_wan, build_tiny_wan22, build_tiny_wan22_ti2v
from rollout.pipelines.tiny.wan_i2v import build_tiny_wan22_i2v, build_tiny_wan_i2v
from rollout.pipelines.tiny.z_image import TinyZImageSizes, build_tiny_z_image

# Family name -> builder(path, seed=0) -> path, from the family descriptors.
TINY_BUILDERS = {family.name: family.build_tiny for family in FAMILIES}

__all__ = [
    "TINY_BUILDERS",
    "TinyFlux2KleinSizes",
    "TinyFluxSizes",
    "TinyHunyuanVideo15Sizes",
    "TinyLTX2Sizes",
    "TinyQwenImage21Sizes",
    "TinyQwenImageSizes",
    "TinySD3Sizes",
    "TinyWanSizes",
    "TinyZImageSizes",
    "build_tiny_flux",
    "build_tiny_flux_kontext",
    "build_tiny_flux2_dev",
    "build_tiny_flux2_klein",
    "build_tiny_hunyuan_video15",
    "build_tiny_hunyuan_video15_i2v",
    "build_tiny_ltx2",
    "build_tiny_ltx2_i2v",
    "build_tiny_qwen_image",
    "build_tiny_qwen_image21",
    "build_tiny_qwen_image_edit",
    "build_tiny_qwen_image_edit_plus",
    "build_tiny_sd3",
    "build_tiny_wan",
    "build_tiny_wan22",
    "build_tiny_wan22_ti2v",
    "build_tiny_wan_i2v",
    "build_tiny_wan22_i2v",
    "build_tiny_z_image",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.pipelines.tiny",
        description="Build a tiny diffusers pipeline with random weights and save it to a folder.",
    )
    parser.add_argument("out_dir", help="folder to write the pipeline to (created if missing)")
    parser.add_argument(
        "--family",
        choices=list(TINY_BUILDERS),
        default="sd3",
        help=f"{families_help()} (default: sd3)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    TINY_BUILDERS[args.family](args.out_dir, seed=args.seed)
