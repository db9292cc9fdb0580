"""Weights saved as safetensors: which files a path names, and their tensor specs from the headers
alone (no tensor data is read), so an update from disk is checked before anything loads."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from rollout.weights import TensorSpec

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_files(path: str | Path) -> list[Path]:
    """A .safetensors file, or every .safetensors file of a folder (a diffusers component folder,
    possibly sharded). Raises ValueError naming the path when there is none."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
    raise ValueError(
        f"{str(path)!r} is neither a .safetensors file nor a folder holding one "
        "(save one with safetensors.torch.save_file or model.save_pretrained)"
    )


def read_specs(files: list[Path]) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor in the files, from their JSON headers."""
    specs = {}
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPES:
                raise ValueError(f"{file}: tensor {name} has dtype {entry['dtype']}, which is not supported")
            specs[name] = TensorSpec(tuple(entry["shape"]), _DTYPES[entry["dtype"]])
    return specs
