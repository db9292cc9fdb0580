"""A pipeline folder's model_index.json, read after checking that the folder holds a supported
pipeline. Imports neither torch nor diffusers: a recipe checks its `model.path` with it before
anything loads."""

from __future__ import annotations

import json
from pathlib import Path

from rollout.pipelines.families import FAMILIES
from rollout.pipelines.sampling_defaults import SamplingDefaults


def read_model_index(path: str | Path) -> dict:
    """The folder's model_index.json, after checking that the folder is a supported pipeline.

    Raises ValueError naming the folder (or its sampling_defaults.json) and what to do about it.
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
    supported = dict.fromkeys(family.pipeline_class for family in FAMILIES)
    if class_name not in supported:
        raise ValueError(
            f"model folder {str(folder)!r} holds a {class_name}, which is not supported; "
            f"supported pipelines: {', '.join(supported)}"
        )
    SamplingDefaults.read(folder)  # its keys and values; what the model takes is checked as it loads
    return index
