"""Pipelines the throughput benchmark builds (random weights, nothing downloaded), per family.

small  a transformer big enough to dominate the time on a CPU, tiny text encoders and VAE: the
       engine's overhead shows against real model work in seconds;
real   the transformer of the published model (the family's `real_model`) from its config with
       random weights, text encoders one layer deep but of the real widths (FLUX.2 [klein]'s 27
       deep: its pipeline reads layer 27), and a small VAE with the real scale factors and latent
       channels: a GPU measurement of the real per-step work. The
       transformers have 1.4B to 20B parameters (Wan 2.2: two of 14.3B): build them on the GPU.

Each family declares its presets (`Family.presets`: `Preset` rows beside its tiny builder, in its
folder's tiny.py under rollout/pipelines/families/); this module adds the sizes the benchmark
samples at. Video families sample `num_frames` frames of `height` x `width`; their default sizes
are in DEFAULT_VIDEO_SIZE and DEFAULT_NUM_FRAMES.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from rollout.pipelines.families import FAMILIES, family_named
from rollout.pipelines.families.flux.tiny import FLUX1_DEV
from rollout.pipelines.families.flux2.tiny import FLUX2_KLEIN_4B, FLUX2_KLEIN_9B
from rollout.pipelines.families.qwen_image.tiny import QWEN_IMAGE
from rollout.pipelines.families.sd3.tiny import SD35_MEDIUM
from rollout.pipelines.families.wan.tiny import WAN21_T2V_1_3B, WAN22_T2V_A14B_EXPERT, WAN_SMALL
from rollout.pipelines.families.z_image.tiny import Z_IMAGE_TURBO
from rollout.pipelines.family import PRESET_NAMES
from rollout.pipelines.tiny.builder import REAL_VAE_BLOCKS

__all__ = [
    "DEFAULT_NUM_FRAMES",
    "DEFAULT_SIZE",
    "DEFAULT_VIDEO_SIZE",
    "FLUX1_DEV",
    "FLUX2_KLEIN_4B",
    "FLUX2_KLEIN_9B",
    "PRESETS",
    "QWEN_IMAGE",
    "REAL_VAE_BLOCKS",
    "SD35_MEDIUM",
    "VIDEO_FAMILIES",
    "WAN21_T2V_14B",
    "WAN21_T2V_1_3B",
    "WAN22_T2V_A14B_EXPERT",
    "WAN_SMALL",
    "Z_IMAGE_TURBO",
    "build",
    "built",
]

PRESETS = PRESET_NAMES  # every family builds each

# Wan 2.1 T2V 14B's transformer, as its published config.json (Wan-AI/Wan2.1-T2V-14B-Diffusers,
# transformer/) gives it: 40 heads of 128 (width 5120), a 13824 MLP, 40 layers, the rest as the 1.3B.
# Each of Wan 2.2 A14B's experts has the same shape; the parallel cost model sizes its layouts on it.
WAN21_T2V_14B = WAN21_T2V_1_3B | {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
VIDEO_FAMILIES = tuple(family.name for family in FAMILIES if family.video)

# Image side each preset samples at by default (pixels): 256 image tokens for the small models, as
# for the real ones at 512x512 (VAE scale 8, 2x2 patches).
DEFAULT_SIZE = {"small": 64, "real": 512}
# Video (height, width) and frames per preset. small: the tiny VAE halves space and time, so 9 frames
# of 32x32 are 5 latent frames of 8x8 tokens (320 per video, about an image's 256 above); real:
# Wan's 480p at 33 frames, 9 latent frames of 30x52 tokens (14040 per video).
DEFAULT_VIDEO_SIZE = {"small": (32, 32), "real": (480, 832)}
DEFAULT_NUM_FRAMES = {"small": 9, "real": 33}


def build(family: str, preset: str, folder: str | Path, device: str, dtype: torch.dtype) -> Path:
    """Build the benchmark pipeline of `family` and `preset` into `folder`: modules made on `device`,
    saved in `dtype` (a real transformer is made on the GPU and saved in bfloat16). A small one is
    made on the CPU in float32 whatever the device, so its random weights are the same everywhere
    (the engine casts them as it loads)."""
    if preset == "small":
        device, dtype = "cpu", torch.float32
    return family_named(family).build_preset(preset, folder, device, dtype)


# The file that says which preset a reused folder holds (`built`); written after the build, so a
# folder whose build was cut off is never taken for a finished one.
BUILT_MARKER = "benchmark_preset.json"


@contextlib.contextmanager
def built(family: str, preset: str, device: str, dtype: torch.dtype, folder: Path | None = None) -> Iterator[Path]:
    """The folder of `family`'s `preset` pipeline for one benchmark run. With `folder` (a
    benchmark's --model-folder), built there once and reused by later runs asking for the same
    family, preset and dtype (the GPU suite builds FLUX.1-dev's 24 GB once for its several
    benchmarks); without, built in a temporary folder removed afterwards."""
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-") as scratch:
            yield build(family, preset, scratch, device, dtype)
        return
    folder = Path(folder)
    wanted = {"family": family, "preset": preset, "dtype": str(dtype).removeprefix("torch.")}
    marker = folder / BUILT_MARKER
    if marker.exists():
        held = json.loads(marker.read_text())
        if held != wanted:
            raise ValueError(f"--model-folder {folder} holds {held}, not {wanted}: give another folder, or empty it")
    elif folder.exists() and any(folder.iterdir()):
        raise ValueError(f"--model-folder {folder} is not empty and holds no {BUILT_MARKER}: give an empty folder")
    else:
        build(family, preset, folder, device, dtype)
        marker.write_text(json.dumps(wanted))
    yield folder
