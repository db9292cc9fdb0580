"""Saving a freshly built tiny pipeline, the same way for every family, with a stamp of the builder
that made it, so that a folder kept for reuse (a recipe's `model.tiny_cache_dir`) is rebuilt once
the builders change instead of being loaded with another version's sizes."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BUILD_STAMP = "tiny_build.json"  # beside model_index.json; diffusers' from_pretrained ignores it
# The libraries whose classes, saved configs and random initialisation a tiny build depends on.
BUILDING_LIBRARIES = ("diffusers", "transformers", "torch")


def save(pipeline, path: Path, dtype: torch.dtype) -> Path:
    """Save `pipeline` (built in float32) to `path` in `dtype`, stamped with `builder_digest()`;
    returns `path`."""
    if dtype != torch.float32:  # diffusers warns when a float32 pipeline is cast to float32
        pipeline.to(dtype=dtype)
    pipeline.save_pretrained(path)
    (Path(path) / BUILD_STAMP).write_text(json.dumps({"builder": builder_digest()}) + "\n")
    logger.info("saved a tiny %s to %s", type(pipeline).__name__, path)
    return path


def builder_digest() -> str:
    """SHA-256 of the tiny builders' source (every module of this package) and of the versions of the
    libraries whose classes and random initialisation they use: any change to how a tiny pipeline is
    made changes it (a changed comment too, which costs one needless rebuild; a version number bumped
    by hand would be forgotten, as the Qwen edit VAE's rebuild showed). An upgraded diffusers can
    save a class's config with other fields and defaults, so a folder saved by the old one is stale."""
    digest = hashlib.sha256()
    for library in BUILDING_LIBRARIES:
        digest.update(f"{library}=={importlib.metadata.version(library)}\0".encode())
    for module in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(module.name.encode() + b"\0" + module.read_bytes() + b"\0")
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
