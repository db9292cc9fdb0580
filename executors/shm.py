"""Moving Python objects with tensors between processes: the tensors through one shared-memory
block, everything else as a small pickle.

`pack` pickles an object with every tensor replaced by a reference into a block it allocates in
/dev/shm (tmpfs: POSIX shared memory on Linux); `unpack` rebuilds the object with tensors that are
views of that block, so the data is copied once, into the block. The pickle that crosses the pipe
stays a few hundred bytes however large the tensors are. Blocks are plain files named with a
per-engine prefix, so whoever owns the prefix can remove any block a crashed process left behind.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

_ALIGN = 64  # bytes; keeps every tensor's data aligned for fast copies


def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class TensorRef:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Packed:
    """A picklable stand-in for an object: its pickle plus the shared-memory block of its tensors."""

    payload: bytes
    block: str | None  # file name of the block, None when the object holds no tensor
    refs: tuple[TensorRef, ...] = ()
    reused: bool = False  # the block is a `ReusableBlock`: copy out, never remove


class _Pickler(pickle.Pickler):
    """Pickles tensors by reference into `tensors`; a tensor object met twice is sent once, so
    objects that share a tensor (the samples of one prompt share its embeddings) still share it
    after `unpack`."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(tensor) -> its index; `tensors` keeps the ids alive

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if id(obj) not in self._index:
                self._index[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return self._index[id(obj)]
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors: list[torch.Tensor]):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid):
        return self.tensors[pid]


def pack(obj, prefix: str, reusable: ReusableBlock | None = None) -> Packed:
    """Pickle `obj`, putting its tensors (moved to CPU) into a new block named `prefix`-*, or into
    `reusable` (then readers copy the tensors out, and the block is rewritten by the next call)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    if not pickler.tensors:
        return Packed(buffer.getvalue(), None)
    tensors = [t.detach().to("cpu").contiguous() for t in pickler.tensors]
    refs, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        refs.append(TensorRef(size, nbytes, t.dtype, tuple(t.shape)))
        size += -(-nbytes // _ALIGN) * _ALIGN
    if reusable is not None:
        return Packed(buffer.getvalue(), reusable.write(tensors, refs, size), tuple(refs), reused=True)
    name = f"{prefix}-{uuid.uuid4().hex}"
    with open(shm_dir() / name, "w+b") as file:
        file.truncate(max(size, 1))
        for t, ref in zip(tensors, refs, strict=True):
            if ref.nbytes:
                # A plain write is about twice as fast as copying into a fresh mapping, which
                # page-faults on every page it touches.
                os.pwrite(file.fileno(), _bytes(t).numpy(), ref.offset)
    return Packed(buffer.getvalue(), name, tuple(refs))


def unpack(packed: Packed, remove: bool) -> object:
    """Rebuild the object. Its tensors are views of a fresh block (no copy: the mapping lives as
    long as any of them does), or copies out of a reusable one. With `remove`, a fresh block's
    name is deleted at once (the last reader does this; the memory is freed with the last view)."""
    tensors = []
    if packed.block is not None:
        path = shm_dir() / packed.block
        used = max(1, max(ref.offset + ref.nbytes for ref in packed.refs))  # a reused block may be larger
        with open(path, "r+b") as file:
            # Populating the mapping at once is cheaper than faulting it in page by page.
            memory = mmap.mmap(file.fileno(), used, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        if remove and not packed.reused:
            path.unlink(missing_ok=True)
        for ref in packed.refs:
            if ref.nbytes == 0:
                tensors.append(torch.empty(ref.shape, dtype=ref.dtype))
                continue
            data = torch.frombuffer(memory, dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
            tensors.append(data.clone() if packed.reused else data)
        tensors = [t.view(ref.dtype).reshape(ref.shape) for t, ref in zip(tensors, packed.refs, strict=True)]
    return _Unpickler(io.BytesIO(packed.payload), tensors).load()


class ReusableBlock:
    """A shared-memory file the engine keeps mapped and rewrites for every call's arguments, so a
    large update does not pay for fresh zeroed pages on each call. Safe because readers copy the
    tensors out before they reply, and the engine waits for the replies before the next write; a
    call that timed out may still be reading, so after a timeout the engine `abandon`s the block
    (readers keep their own mapping of it) and the next call gets a new one."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.name: str | None = None
        self._memory: mmap.mmap | None = None
        self._view: torch.Tensor | None = None

    def write(self, tensors: list[torch.Tensor], refs: list[TensorRef], size: int) -> str:
        if self._view is None or self._view.numel() < size:
            # Grow by at least half, so buckets of slightly varying size do not each need a new file.
            size = max(size, 1, 3 * self._view.numel() // 2 if self._view is not None else 0)
            self.abandon()
            self.name = f"{self.prefix}-args-{uuid.uuid4().hex}"
            with open(shm_dir() / self.name, "w+b") as file:
                file.truncate(size)
                self._memory = mmap.mmap(file.fileno(), size)
            self._view = torch.frombuffer(self._memory, dtype=torch.uint8)
        for t, ref in zip(tensors, refs, strict=True):
            if ref.nbytes:
                self._view[ref.offset : ref.offset + ref.nbytes].copy_(_bytes(t))
        return self.name

    def abandon(self) -> None:
        """Stop using this file: unlink its name and drop the engine's mapping."""
        if self.name is not None:
            (shm_dir() / self.name).unlink(missing_ok=True)
        self._view = None
        if self._memory is not None:
            self._memory.close()
        self.name, self._memory = None, None


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def discard(packed: Packed) -> None:
    """Delete a fresh block nobody will read (e.g. the reply of a timed-out call)."""
    if packed.block is not None and not packed.reused:
        (shm_dir() / packed.block).unlink(missing_ok=True)


def remove_blocks(prefix: str) -> None:
    """Delete every block named `prefix`-*: what a crashed process may have left behind."""
    for path in shm_dir().glob(f"{prefix}-*"):
        path.unlink(missing_ok=True)


def block_prefix() -> str:
    """A prefix unique to one engine: its pid plus a random part."""
    return f"rollout-{os.getpid()}-{uuid.uuid4().hex[:8]}"
