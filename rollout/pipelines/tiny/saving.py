"""Saving a freshly built tiny pipeline, the same way for every family, with a stamp of the builder
that made it, so that a folder kept for reuse (a recipe's `model.tiny_cache_dir`) is rebuilt once
the builders change instead of being loaded with another version's sizes; and with the size a
request that sets none is made at (`sampling_defaults.json`), the tiny modules' own instead of the
published pipeline's (Wan's 480 x 832 at 81 frames took minutes on a CPU)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollout.pipelines.sampling_defaults import FILE_NAME, SamplingDefaults

logger = logging.getLogger(__name__)

BUILD_STAMP = "tiny_build.json"  # beside model_index.json; diffusers' from_pretrained ignores it
# The libraries whose classes, saved configs and random initialisation a tiny build depends on.
BUILDING_LIBRARIES = ("diffusers", "transformers", "torch")
# What the tiny folders default to: the sizes their modules are made for (as tests/families.py's
# requests). A builder's sizes name one of these; the real presets' name none.
TINY_IMAGE = SamplingDefaults(height=32, width=32)
TINY_VIDEO = SamplingDefaults(height=32, width=32, num_frames=9)
TINY_FRAMES = SamplingDefaults(num_frames=9)  # HunyuanVideo 1.5: its size comes from its config's target_size


@dataclass
class InMemory:
    """A builder's destination that keeps the pipeline instead of saving it: the memory plan builds a
    family's real preset on the meta device (`device="meta"`), where nothing can be written."""

    pipeline: Any = None


def save(
    pipeline, path: Path | InMemory, dtype: torch.dtype, sampling_defaults: SamplingDefaults | None
) -> Path | InMemory:
    """Save `pipeline` (built in float32) to `path` in `dtype` with its `sampling_defaults` (None:
    its pipeline's own), stamped with `builder_digest()`; returns `path`. An `InMemory` `path`
    keeps the pipeline, cast to `dtype`, and writes nothing."""
    if dtype != torch.float32:  # diffusers warns when a float32 pipeline is cast to float32
        pipeline.to(dtype=dtype)
    if isinstance(path, InMemory):
        path.pipeline = pipeline
        return path
    pipeline.save_pretrained(path)
    if sampling_defaults is None:
        (Path(path) / FILE_NAME).unlink(missing_ok=True)  # a rebuilt folder keeps no earlier build's
    else:
        sampling_defaults.write(path)
    (Path(path) / BUILD_STAMP).write_text(json.dumps({"builder": builder_digest()}) + "\n")
    logger.info("saved a tiny %s to %s", type(pipeline).__name__, path)
    return path


def builder_digest() -> str:
    """SHA-256 of the tiny builders' source (every module of this package and every family folder's
    `tiny.py`) and of the versions of the libraries whose classes and random initialisation they
    use: any change to how a tiny pipeline is made changes it (a changed comment too, which costs one
    needless rebuild; a version number bumped by hand would be forgotten, as the Qwen edit VAE's
    rebuild showed). An upgraded diffusers can
    save a class's config with other fields and defaults, so a folder saved by the old one is stale."""
    digest = hashlib.sha256()
    for library in BUILDING_LIBRARIES:
        digest.update(f"{library}=={importlib.metadata.version(library)}\0".encode())
    pipelines = Path(__file__).parents[1]
    modules = sorted(pipelines.glob("tiny/*.py")) + sorted(pipelines.glob("families/*/tiny.py"))
    for module in modules:
        name = module.relative_to(pipelines).as_posix()
        digest.update(name.encode() + b"\0" + module.read_bytes() + b"\0")
    return digest.hexdigest()


def is_current_build(folder: Path) -> bool:
    """Whether `folder` holds a tiny pipeline that today's builders made (its stamp matches)."""
    stamp = Path(folder) / BUILD_STAMP
    if not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()).get("builder") == builder_digest()
    except (ValueError, AttributeError):  # not JSON, or not an object: not a stamp of ours
        return False
