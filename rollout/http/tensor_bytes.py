"""Tensors as safetensors bytes, and PNG files in tensors: what every body of tensors on the wire is
made of (`rollout.http.wire`'s frames and bodies, the reward workers' and reward service's groups).

Kept apart from `rollout.http.wire`, which knows the families' conditioning (and so imports diffusers),
so a process that only sends tensors (a reward worker) starts without it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import safetensors.torch
import torch

from rollout.input_images import InputImages

SAFETENSORS_MEDIA_TYPE = "application/octet-stream"  # the Content-Type of a safetensors body
LENGTH = struct.Struct("<Q")  # a frame's length, and a safetensors header's
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_HEADER = struct.Struct(">8sI4sII")  # signature, IHDR's length, b"IHDR", width, height


class WireError(ValueError):
    """Bytes that are not what the protocol says (a malformed safetensors body or frame)."""


# Tensor bodies.


def tensors_to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors file of `tensors` (moved to CPU) with string `metadata`. Tensors that share
    memory (one tensor under two names, overlapping views) are written each with its own values,
    as the process they came from would read them."""
    cpu = _unshared({name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()})
    return safetensors.torch.save(cpu, metadata=dict(metadata) if metadata else None)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (contiguous, on CPU) with a copy of each one whose bytes overlap another's, which
    safetensors refuses to write; views of disjoint parts of one buffer stay as they are."""
    taken: dict[int, list[tuple[int, int]]] = {}  # storage address -> byte ranges already written
    unshared = {}
    for name, tensor in tensors.items():
        start = tensor.storage_offset() * tensor.element_size()
        end = start + tensor.numel() * tensor.element_size()
        ranges = taken.setdefault(tensor.untyped_storage().data_ptr(), [])
        if tensor.numel() and any(start < other_end and other_start < end for other_start, other_end in ranges):
            tensor = tensor.clone()
        else:
            ranges.append((start, end))
        unshared[name] = tensor
    return unshared


def tensors_from_bytes(data: bytes, what: str = "body") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file; WireError names `what` if it is not one."""
    metadata = _read_metadata(data, what)
    try:
        tensors = safetensors.torch.load(data)
    except Exception as error:  # safetensors raises its own SafetensorError (not a public class)
        raise WireError(f"{what} is not a valid safetensors file: {error}") from None
    return tensors, metadata


def _read_metadata(data: bytes, what: str) -> dict[str, str]:
    header, _ = read_header(data, what)
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def read_header(data, what: str) -> tuple[Any, int]:
    """A safetensors file's header (parsed JSON) and where its data starts in `data` (any buffer)."""
    if len(data) < LENGTH.size:
        raise WireError(f"{what} is not a valid safetensors file: {len(data)} bytes, shorter than its header")
    (header_length,) = LENGTH.unpack_from(data)
    if header_length > len(data) - LENGTH.size:
        raise WireError(f"{what} is not a valid safetensors file: its header runs past the end")
    try:
        header = json.loads(data[LENGTH.size : LENGTH.size + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"{what} is not a valid safetensors file: its header is not JSON ({error})") from None
    return header, LENGTH.size + header_length


def png_size(tensor: torch.Tensor, name: str) -> tuple[int, int]:
    """(height, width) of the PNG file whose bytes a uint8 [N] tensor `name` holds, from its header
    alone: a few KB of PNG can hold gigabytes of pixels, so sizes are checked before decoding."""
    if tensor.dtype != torch.uint8 or tensor.ndim != 1:
        raise WireError(
            f"tensor {name!r} must hold a PNG file's bytes as uint8 [N], got {tensor.dtype} {list(tensor.shape)}"
        )
    # A PNG file is its signature, then its IHDR chunk: length, b"IHDR", width, height (big-endian).
    head = tensor[: _PNG_HEADER.size].numpy().tobytes()
    if len(head) < _PNG_HEADER.size:
        raise WireError(f"tensor {name!r} is not a PNG file: {len(head)} bytes, shorter than a PNG header")
    signature, _, chunk, width, height = _PNG_HEADER.unpack(head)
    if signature != _PNG_SIGNATURE or chunk != b"IHDR":
        raise WireError(f"tensor {name!r} is not a PNG file: it does not start with a PNG signature and IHDR chunk")
    return height, width


def png_image(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """The RGB image (uint8 [3, H, W]) in a uint8 [N] tensor `name` that holds a PNG file's bytes
    (check its `png_size` first: this decodes it)."""
    import io

    from PIL import Image

    png_size(tensor, name)
    try:
        with Image.open(io.BytesIO(tensor.numpy().tobytes()), formats=["PNG"]) as image:
            rgb = image.convert("RGB")
    except Exception as error:
        raise WireError(f"tensor {name!r} is not a PNG file: {error}") from None
    return InputImages.of([rgb]).tensors[0]
