"""Tensors as safetensors bytes, and PNG files in tensors: what every body of tensors on the wire is
made of (`rollout.http.wire`'s frames and bodies, the reward workers' and reward service's groups).

Kept apart from `rollout.http.wire`, which knows the families' conditioning (and so imports diffusers),
so a process that only sends tensors (a reward worker) starts without it.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import safetensors.torch
import torch

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
    (check its `png_size` first: this decodes it). A file whose image data is shorter than its
    header announces is refused, as a cut-off file is."""
    import io

    import numpy as np
    from PIL import Image

    png_size(tensor, name)
    data = tensor.numpy().tobytes()
    _check_image_data(data, name)
    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            rgb = image.convert("RGB")
    except Exception as error:
        raise WireError(f"tensor {name!r} is not a PNG file: {error}") from None
    # [H, W, 3] over a copy of the pixels, then one copy channels-first: no copy more (a 4096 x 4096
    # image is 50 MB a copy, and a server decodes many).
    pixels = np.asarray(rgb)
    del rgb
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


_SAMPLES_PER_PIXEL = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by PNG colour type: grey, RGB, palette, grey+alpha, RGBA
# Adam7's passes: (first column, first row, column step, row step).
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_INFLATE_STEP = 1 << 20


def _check_image_data(data: bytes, name: str) -> None:
    """Raise WireError if the PNG file's image data (its IDAT chunks, inflated) is shorter than its
    IHDR chunk announces. PIL reads the missing rows as zeros when the zlib stream ends early but
    whole: a 64 x 64 image whose data held 8 rows was taken, its 56 other rows black."""
    header, image_data, position = None, [], len(_PNG_SIGNATURE)
    view = memoryview(data)
    while position + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        body = view[position + 8 : position + 8 + length]
        if kind == b"IHDR":
            header = bytes(body)
        elif kind == b"IDAT":
            image_data.append(body)
        elif kind == b"IEND":
            break
        position += 12 + length  # length, kind, body, CRC
    if header is None or len(header) < 13:
        raise WireError(f"tensor {name!r} is not a PNG file: its IHDR chunk is missing or short")
    width, height, depth, colour, _, _, interlaced = struct.unpack_from(">IIBBBBB", header)
    if colour not in _SAMPLES_PER_PIXEL:
        raise WireError(f"tensor {name!r} is not a PNG file: colour type {colour} is not one of PNG's")
    bits = depth * _SAMPLES_PER_PIXEL[colour]
    expected = 0
    for x0, y0, dx, dy in _ADAM7 if interlaced else ((0, 0, 1, 1),):
        columns, rows = -(-(width - x0) // dx) if width > x0 else 0, -(-(height - y0) // dy) if height > y0 else 0
        if columns and rows:
            expected += rows * (1 + (columns * bits + 7) // 8)  # a filter byte, then the row's samples
    inflated = _inflated_bytes(image_data, expected, name)
    if inflated < expected:
        raise WireError(
            f"tensor {name!r} is not a whole PNG file: its image data inflates to {inflated} bytes, where its header "
            f"({width} x {height}, {depth}-bit colour type {colour}) needs {expected}: rows are missing"
        )


def _inflated_bytes(pieces: list[memoryview], most: int, name: str) -> int:
    """How many bytes the zlib stream in `pieces` inflates to (counted up to just past `most`, in
    steps: the pixels are not held)."""
    inflater, inflated = zlib.decompressobj(), 0
    try:
        for piece in pieces:
            out = inflater.decompress(piece, _INFLATE_STEP)
            inflated += len(out)
            while (inflater.unconsumed_tail or len(out) == _INFLATE_STEP) and inflated <= most:
                out = inflater.decompress(inflater.unconsumed_tail, _INFLATE_STEP)
                inflated += len(out)
            if inflater.eof or inflated > most:
                break
    except zlib.error as error:
        raise WireError(f"tensor {name!r} is not a PNG file: its image data is not a zlib stream ({error})") from None
    return inflated
