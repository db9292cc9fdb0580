"""Find, check and load a local diffusers pipeline folder into the adapter for its model family."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Pipeline class (model_index.json `_class_name`) -> adapter. More families (FLUX) join here.
SUPPORTED_PIPELINES = ("StableDiffusion3Pipeline",)


def read_model_index(path: str | Path) -> dict:
    """The folder's model_index.json, after checking that the folder is a supported pipeline.

    Raises ValueError naming the folder and what to do about it.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"model folder {str(folder)!r} does not exist; pass a local diffusers pipeline folder "
            "(build a tiny one with `python -m rollout.pipelines.tiny DIR`)"
        )
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise ValueError(
            f"model folder {str(folder)!r} is not a diffusers pipeline: it has no model_index.json "
            "(save one with `pipeline.save_pretrained(DIR)`)"
        )
    index = json.loads(index_file.read_text())
    class_name = index.get("_class_name")
    if class_name not in SUPPORTED_PIPELINES:
        raise ValueError(
            f"model folder {str(folder)!r} holds a {class_name}, which is not supported; "
            f"supported pipelines: {', '.join(SUPPORTED_PIPELINES)}"
        )
    return index


def load_adapter(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Load the pipeline with diffusers' `from_pretrained` (local files only) and wrap it."""
    from diffusers import StableDiffusion3Pipeline

    from rollout.pipelines.sd3 import SD3Adapter

    index = read_model_index(path)
    # Components saved as [null, null] (e.g. SD3 without T5) must be passed explicitly as None.
    absent = {name: None for name, value in index.items() if isinstance(value, list) and value[0] is None}
    pipeline = StableDiffusion3Pipeline.from_pretrained(str(path), dtype=dtype, local_files_only=True, **absent)
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    logger.info("loaded %s from %s on %s (%s)", index["_class_name"], path, device, dtype)
    return SD3Adapter(pipeline)
