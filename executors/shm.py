"""Moving Python objects with tensors between processes: the tensors through one shared-memory
block, everything else as a small pickle.

`pack` pickles an object with every tensor replaced by a reference into a block it allocates in
/dev/shm (tmpfs: POSIX shared memory on Linux); `unpack` rebuilds the object with the tensors read
into the reader's own memory, so nothing a caller keeps pins shared memory (Docker gives /dev/shm
64 MB by default). The pickle that crosses the pipe stays a few hundred bytes however large the
tensors are. Blocks are files only their user can read (0600), with their space reserved up front so
a full /dev/shm is a clear `SharedMemoryFull` error, never a SIGBUS. They are named with the
engine's pid, so whoever owns the prefix, or any later engine once that pid is gone, can remove
what a crashed process left behind.
"""

from __future__ import annotations

import errno
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


class SharedMemoryFull(OSError):
    """A block did not fit in the shared-memory folder."""


def free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _create(name: str, size: int) -> int:
    """A new block of `size` bytes that only this user can read, its space reserved; returns its fd."""
    path = shm_dir() / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as error:
        os.close(fd)
        path.unlink(missing_ok=True)
        if error.errno != errno.ENOSPC:
            raise
        raise SharedMemoryFull(
            errno.ENOSPC,
            f"{shm_dir()} has {free_bytes(shm_dir()) / 2**20:.1f} MiB free, too little for a block of "
            f"{size / 2**20:.1f} MiB; give it more room (docker run --shm-size=2g) or send less at once "
            "(a smaller bucket_bytes or max_batch_size)",
        ) from None
    return fd


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
    fd = _create(name, size)
    try:
        for t, ref in zip(tensors, refs, strict=True):
            if ref.nbytes:
                # A plain write is about twice as fast as copying into a fresh mapping, which
                # page-faults on every page it touches.
                os.pwrite(fd, _bytes(t).numpy(), ref.offset)
    finally:
        os.close(fd)
    return Packed(buffer.getvalue(), name, tuple(refs))


def unpack(packed: Packed, remove: bool) -> object:
    """Rebuild the object, its tensors read into this process's own memory (one copy; a view of
    the block would pin it for as long as the caller keeps the tensor). With `remove`, the block is
    deleted once read (the last reader does this; a reused block is never removed here)."""
    tensors = []
    if packed.block is not None:
        path = shm_dir() / packed.block
        fd = os.open(path, os.O_RDONLY)
        try:
            tensors = [_read(fd, ref) for ref in packed.refs]
        finally:
            os.close(fd)
        if remove and not packed.reused:
            path.unlink(missing_ok=True)
    return _Unpickler(io.BytesIO(packed.payload), tensors).load()


def _read(fd: int, ref: TensorRef) -> torch.Tensor:
    data = torch.empty(ref.nbytes, dtype=torch.uint8)
    view = memoryview(data.numpy())
    done = 0
    while done < ref.nbytes:  # one read returns at most about 2 GiB
        read = os.preadv(fd, [view[done:]], ref.offset + done)
        if read == 0:
            raise EOFError(f"shared-memory block ended {ref.nbytes - done} bytes early")
        done += read
    return data.view(ref.dtype).reshape(ref.shape) if ref.nbytes else torch.empty(ref.shape, dtype=ref.dtype)


class ReusableBlock:
    """A shared-memory file the engine keeps mapped and rewrites for every call's arguments, so a
    large update does not pay for fresh zeroed pages on each call. Safe because readers copy the
    tensors out before they reply, and the engine waits for the replies before the next write; a
    call that timed out may still be reading, so after a timeout the engine `abandon`s the block
    (readers have it open) and the next call gets a new one."""

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
            fd = _create(self.name, size)
            try:
                self._memory = mmap.mmap(fd, size)
            finally:
                os.close(fd)
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


def remove_stale_blocks() -> int:
    """Delete the blocks of engines whose process is gone (killed before it could clean up);
    returns how many. Blocks of live processes, this user's or others', are left alone."""
    removed = 0
    for path in shm_dir().glob("rollout-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                path.unlink()
                removed += 1
            except (FileNotFoundError, PermissionError):
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def block_prefix() -> str:
    """A prefix unique to one engine: its pid plus a random part."""
    return f"rollout-{os.getpid()}-{uuid.uuid4().hex[:8]}"
