"""Frames too big to copy whole (a push of full weights, bucket by bucket), in the format of
`rollout.http.wire`: written in pieces that are views of the tensors' memory, and read into one buffer
per frame, which the tensors decoded from it then view. `rollout.serve.weight_stream` uses both.
"""

from __future__ import annotations

import json
import math
import mmap
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from rollout.http.page_prefault import PagePrefault
from rollout.http.wire import LENGTH, WireError, read_header
from rollout.weights.safetensors_files import DTYPES

_DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
# What one write hands the connection. The client's own sender (`rollout.serve.socket_post`) hands
# the pieces to the kernel as they are, a few MiB per sendmsg, so their size barely matters there.
# httpx (its fallback) copies each piece once (h11 joins it with its chunk header); a piece under
# glibc's mmap threshold (1 MiB as the benchmark pins it) reuses warm heap memory, where 4 MiB ones
# faulted fresh pages in on every copy: httpx's CPU for a 219 MB push went ~0.48 -> ~0.29 s
# (benchmarks/http_weight_push).
_PIECE_BYTES = 512 << 10


def frame_pieces(
    kind: str, fields: Mapping[str, Any] | None = None, tensors: Mapping[str, torch.Tensor] | None = None
) -> Iterator[bytes | memoryview]:
    """`frame(kind, fields, tensors)` in pieces, with no copy of a CPU tensor's bytes: the length
    and header, then views of each tensor's memory (at most 512 KiB each)."""
    cpu = [(name, tensor.detach().to("cpu").contiguous()) for name, tensor in (tensors or {}).items()]
    cpu.sort(key=lambda item: -item[1].element_size())  # every tensor's offset a multiple of its element size
    header: dict[str, Any] = {"__metadata__": {"frame": json.dumps({"kind": kind, **(fields or {})})}}
    size = 0
    for name, tensor in cpu:
        if tensor.dtype not in _DTYPE_CODES:
            raise WireError(
                f"{name}: dtype {tensor.dtype} has no safetensors code; send one of {sorted(map(str, _DTYPE_CODES))}"
            )
        header[name] = {
            "dtype": _DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [size, size + tensor.nbytes],
        }
        size += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-aligned, as safetensors writes it
    yield LENGTH.pack(LENGTH.size + len(encoded) + size) + LENGTH.pack(len(encoded)) + encoded
    for _, tensor in cpu:
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # bfloat16 too: as bytes
        for start in range(0, len(data), _PIECE_BYTES):
            yield data[start : start + _PIECE_BYTES]


class FrameAssembler:
    """Cuts a byte stream into frames as it arrives, each into a buffer of its own (`frame_buffer`;
    see `tensors_from_buffer`), in either of two ways: `feed(chunk)` copies the bytes of a chunk
    and yields each frame completed; or a reader writes the bytes in place, into `get_buffer()`
    (a socket's `recv_into`: no copy of its own), and `buffer_updated(n)` returns the frame they
    complete, if any. `close()` raises if the stream ended inside a frame. A frame longer than
    `max_frame_bytes` is a `FrameTooLarge` as soon as its length arrives."""

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self._length = bytearray(LENGTH.size)  # the length of the next frame, as it arrives
        self._frame: bytearray | mmap.mmap | None = None
        self._prefault: PagePrefault | None = None  # faults a mapped frame in ahead of its bytes
        self._view = memoryview(self._length)  # what get_buffer() offers: the rest of either
        self._filled = 0  # bytes of the length, or of the frame, that have arrived

    def get_buffer(self) -> memoryview:
        """Where the stream's next bytes go (never empty): what is missing of the next frame's
        length, or of the frame."""
        return self._view[self._filled :]

    def buffer_updated(self, nbytes: int) -> bytearray | mmap.mmap | None:
        """Records that `nbytes` were written at the start of `get_buffer()`; returns the frame
        that they complete, if they complete one."""
        self._filled += nbytes
        if self._prefault is not None:
            self._prefault.advance(self._filled)
        if self._filled < len(self._view):
            return None
        if self._frame is not None:
            return self._next_frame()
        (length,) = LENGTH.unpack(self._length)
        if length > self.max_frame_bytes:
            raise FrameTooLarge(f"a frame of {length} bytes is over the limit of {self.max_frame_bytes}")
        self._frame, self._filled = frame_buffer(length), 0
        if isinstance(self._frame, mmap.mmap):
            self._prefault = PagePrefault(self._frame, ahead=min(length // 8, _PREFAULT_AHEAD_BYTES))
        self._view = memoryview(self._frame)
        return self._next_frame() if length == 0 else None

    def _next_frame(self) -> bytearray | mmap.mmap:
        done, self._frame, self._filled, self._prefault = self._frame, None, 0, None
        self._view.release()  # a view left open would keep an mmap from being closed
        self._view = memoryview(self._length)
        return done

    def release(self) -> None:
        """Free the frame in progress now, if there is one (the stream failed or was refused): its
        pages go back at once, not when a traceback that holds this assembler is collected."""
        frame, prefault, self._frame, self._prefault, self._filled = self._frame, self._prefault, None, None, 0
        if frame is None:
            return
        self._view.release()
        self._view = memoryview(self._length)
        if prefault is not None:
            prefault.release()

    def feed(self, chunk) -> Iterator[bytearray | mmap.mmap]:
        view = memoryview(chunk)
        while view:
            target = self.get_buffer()
            taken = min(len(view), len(target))
            target[:taken] = view[:taken]
            view = view[taken:]
            done = self.buffer_updated(taken)
            if done is not None:
                yield done

    def close(self) -> None:
        if self._filled or self._frame is not None:
            held = self._filled + (LENGTH.size if self._frame is not None else 0)
            raise WireError(f"the stream ended inside a frame ({held} bytes of it arrived)")


def frame_buffer(length: int) -> bytearray | mmap.mmap:
    """A writable buffer of `length` bytes for one frame. A big one is memory mapped, unreserved:
    its pages are memory only once written, so a frame's length announces address space, not
    memory. Once some of a frame has come, `FrameAssembler` has a thread fault the rest in ahead of
    its bytes (`rollout.http.page_prefault`): filling fresh pages costs a fault each, which made copying
    a bucket in 5x slower than the copy itself (0.5 vs 2.9 GB/s), and so the faults leave the
    thread that fills it (the server's event loop).

    Plain pages, not transparent huge pages: with THP in `madvise` mode (the usual default) a
    `MADV_HUGEPAGE` mapping makes the kernel compact memory on the spot to find free 2 MiB pages,
    and on a machine whose memory other processes churn that cost the receiving server 0.5 to
    3.0 s of CPU per GB (median 1.4) and a streamed 1 GB push 160-725 MB/s; with 4 KiB pages the
    same pushes took 0.55-0.66 s/GB and ran at 580-670 MB/s (load ~6 on 2 cores;
    benchmarks/http_weight_push, server process CPU)."""
    if length < _MAPPED_BYTES:
        return bytearray(length)
    return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)


_MAPPED_BYTES = 2 << 20
# <bits/mman-linux.h>; Python's mmap module names it from 3.13. Without it, a frame announced
# bigger than the machine's free memory would be refused by the kernel's overcommit heuristic.
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0
# A frame's pages are faulted in at most an eighth of it (32 MiB at most) ahead of its bytes
# (`rollout.http.page_prefault`): a sender that stops costs what it sent and that much more, one
# frame at a time (the server reads one push at a time, and frees a failed frame at once). The
# event loop takes no faults, as when the whole frame was faulted in at once.
_PREFAULT_AHEAD_BYTES = 32 << 20


class FrameTooLarge(WireError):
    """A frame announces more bytes than the reader takes."""


def tensors_from_buffer(buffer: bytearray | mmap.mmap, what: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a safetensors file held in `buffer`, as views of it (no copy), and its frame
    fields (metadata "frame", JSON). WireError names `what` if the file is malformed."""
    header, start = read_header(buffer, what)
    if not isinstance(header, dict):
        raise WireError(f"{what} is not a valid safetensors file: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    try:
        fields = json.loads(metadata["frame"])
        entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    except (KeyError, TypeError, IndexError, json.JSONDecodeError) as error:
        raise WireError(f"{what} has no valid 'frame' metadata or tensor offsets ({error!r})") from None
    tensors, end = {}, 0
    for name, entry in entries:
        tensors[name] = _tensor_view(buffer, start, end, name, entry, what)
        end = entry["data_offsets"][1]
    if start + end != len(buffer):
        raise WireError(
            f"{what} is not a valid safetensors file: its tensors end at byte {start + end} of {len(buffer)}"
        )
    return tensors, fields


def _tensor_view(
    buffer: bytearray | mmap.mmap, start: int, end: int, name: str, entry: Any, what: str
) -> torch.Tensor:
    """Tensor `name` of a safetensors buffer, whose previous tensor ended at data byte `end`."""
    try:
        dtype, shape, (first, last) = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        if not all(isinstance(n, int) and n >= 0 for n in (*shape, first, last)):
            raise ValueError("negative or non-integer sizes")
    except (KeyError, TypeError, ValueError) as error:
        raise WireError(f"{what}: tensor {name!r} has a malformed entry {entry!r} ({error!r})") from None
    numel = math.prod(shape)
    if first != end or last - first != numel * dtype.itemsize or start + last > len(buffer):
        raise WireError(
            f"{what}: tensor {name!r} ({entry['dtype']} {shape}) does not fit its data offsets {[first, last]}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=numel, offset=start + first).view(shape)
