"""Weights saved as safetensors: which files a path names, and their tensor specs from the headers
alone (no tensor data is read), so an update from disk is checked before anything loads. Only
regular files are read (`rollout.weights.regular_files`): a FIFO or a device named like weights is refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from rollout.weights.regular_files import check_regular, open_regular
from rollout.weights.state import TensorSpec

# safetensors refuses headers past 100 MB; so does this check, before reading one.
MAX_HEADER_BYTES = 100_000_000

DTYPES = {  # safetensors dtype code -> torch dtype
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
    if path.suffix == ".safetensors" and not path.is_dir():
        return [check_regular(path, "weights file")]
    if path.is_dir():
        files = [check_regular(file, "weights file") for file in sorted(path.glob("*.safetensors"))]
        if files:
            return files
    raise ValueError(
        f"{str(path)!r} is neither a .safetensors file nor a folder holding one "
        "(save one with safetensors.torch.save_file or model.save_pretrained)"
    )


def read_specs(files: list[Path]) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor in the files, from their JSON headers."""
    specs = {}
    # The tensors go by their place in the header, not their names: these files may be anyone's
    # (`WeightSync.check_specs` names only the model's own).
    for file in files:
        for index, (name, entry) in enumerate(_header(file).items()):
            if name == "__metadata__":
                continue
            if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list) and "dtype" in entry):
                raise ValueError(f"{str(file)!r} is not a safetensors file: its header's entry #{index} is malformed")
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"{file}: its header's entry #{index} has a dtype this engine does not support")
            specs[name] = TensorSpec(tuple(entry["shape"]), DTYPES[entry["dtype"]])
    return specs


def _header(file: Path) -> dict:
    not_safetensors = f"{str(file)!r} is not a safetensors file"
    with open_regular(file, "weights file") as handle:
        prefix = handle.read(8)
        (length,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (None,)
        if length is None or length > MAX_HEADER_BYTES:
            raise ValueError(f"{not_safetensors}: its header length is missing or past {MAX_HEADER_BYTES} bytes")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{not_safetensors}: its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{not_safetensors}: its header is not a JSON object")
    return header
