"""Moving Python objects with tensors between processes: the tensors through one shared-memory
block, everything else as a small pickle.

`pack` pickles an object with every tensor replaced by a reference into a block in /dev/shm
(tmpfs: POSIX shared memory on Linux); `unpack` rebuilds the object with the tensors copied into
the reader's own memory, so nothing a caller keeps pins shared memory (Docker gives /dev/shm 64 MB
by default). The pickle that crosses the pipe stays a few hundred bytes however large the tensors
are. Blocks are files only their user can read (0600), with their space reserved up front so a
full /dev/shm is a clear `SharedMemoryFull` error, never a SIGBUS. They are named with the
engine's pid, so whoever owns the prefix, or any later engine once that pid is gone, can remove
what a crashed process left behind.

A block is either fresh or reused. A fresh block is made for one message and removed by its last
reader. A `ReusableBlock` is one file its writer keeps mapped and rewrites for every message
(an engine's RPC arguments, a worker's replies): no file to create, fill with zeroed pages and
remove per message, which is most of what a small message costs. Its reader keeps it mapped too
(`ReusedBlockReader`) and copies the tensors out. That is safe because no reader is still copying
when its writer rewrites the block. A worker serves one call at a time and writes a reply only
while serving the call it answers; the engine copies a reply out before it sends that worker
another call, and drops unread the late reply of a call it gave up on. The engine rewrites its
argument block only once every rank has answered the last call, and abandons the block (a fresh
name for the next call) when one did not. A worker's reply block is bounded
(`REPLY_BLOCK_MAX_BYTES`); a bigger reply takes a fresh block, so a worker holds at most that much
/dev/shm between calls.
"""

from __future__ import annotations

import ctypes
import errno
import io
import mmap
import os
import pickle
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

_ALIGN = 64  # bytes; keeps every tensor's data aligned for fast copies
# The biggest reply a worker writes into its reusable block; bigger ones take a fresh block. Above
# a few MiB the copies cost more than making a block, and this bounds what each worker keeps.
REPLY_BLOCK_MAX_BYTES = 4 * 2**20


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


# Where one tensor lies in a block: (offset, nbytes, dtype, shape). A plain tuple: it pickles in
# half the time of a dataclass, and a finishing step sends one per tensor.
TensorRef = tuple[int, int, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class Packed:
    """A picklable stand-in for an object: its pickle plus the shared-memory block of its tensors."""

    payload: bytes
    block: str | None  # file name of the block, None when the object holds no tensor
    refs: tuple[TensorRef, ...] = ()
    reused: bool = False  # the block is a `ReusableBlock`: copy out, never remove


class _Pickler(pickle.Pickler):
    """Pickles tensors by reference into `tensors`. Pickle's memo sends a tensor object met twice
    once, so objects that share a tensor (the samples of one prompt share its embeddings) still
    share it after `unpack`. (`reducer_override` rather than `persistent_id`: pickle asks it about
    objects only, not about every int and string, which halves the time of a step's outputs.)"""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return _packed_tensor, (len(self.tensors) - 1,)
        return NotImplemented


def _packed_tensor(index: int) -> torch.Tensor:
    """What a packed tensor's pickle names; `_Unpickler` puts the tensor there instead."""
    raise RuntimeError("a packed tensor is rebuilt by executors.shm.unpack, not by a plain unpickler")


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors: list[torch.Tensor]):
        super().__init__(file)
        self.tensors = tensors

    def find_class(self, module, name):
        if module == __name__ and name == _packed_tensor.__name__:
            return self.tensors.__getitem__
        loaded = sys.modules.get(module)
        if loaded is not None and "." not in name:
            # What the base class would find, without its import call (a few us per class, and
            # a finishing step's reply names seven): the peer is our own worker or engine.
            return getattr(loaded, name)
        return super().find_class(module, name)


def pack(obj, prefix: str, reusable: ReusableBlock | None = None) -> Packed:
    """Pickle `obj`, putting its tensors (moved to CPU) into `reusable` when given and big enough
    (readers copy them out; the next call rewrites it), else into a new block named `prefix`-*."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    if not pickler.tensors:
        return Packed(buffer.getvalue(), None)
    tensors = [_plain_cpu(t) for t in pickler.tensors]
    refs, size = [], 0
    for t in tensors:
        nbytes = t.nbytes
        refs.append((size, nbytes, t.dtype, tuple(t.shape)))
        size += -(-nbytes // _ALIGN) * _ALIGN
    if reusable is not None and reusable.takes(size):
        return Packed(buffer.getvalue(), reusable.write(tensors, refs, size), tuple(refs), reused=True)
    name = f"{prefix}-{uuid.uuid4().hex}"
    fd = _create(name, size)
    try:
        for t, ref in zip(tensors, refs, strict=True):
            # A plain write is about twice as fast as copying into a fresh mapping, which
            # page-faults on every page it touches.
            _write(fd, t, ref)
    finally:
        os.close(fd)
    return Packed(buffer.getvalue(), name, tuple(refs))


def unpack(packed: Packed, remove: bool, reader: ReusedBlockReader | None = None) -> object:
    """Rebuild the object, its tensors copied into this process's own memory (a view of the block
    would pin it for as long as the caller keeps the tensor). With `remove`, a fresh block is
    deleted once read (the last reader does this; a reused block is never removed here). A reused
    block is read through `reader`, which keeps it mapped for the next message, when given."""
    tensors = []
    if packed.block is not None and packed.reused and reader is not None:
        tensors = reader.read(packed)
    elif packed.block is not None:
        path = shm_dir() / packed.block
        fd = os.open(path, os.O_RDONLY)
        try:
            tensors = [_read(fd, ref) for ref in packed.refs]
        finally:
            os.close(fd)
        if remove and not packed.reused:
            path.unlink(missing_ok=True)
    return _Unpickler(io.BytesIO(packed.payload), tensors).load()


def _write(fd: int, tensor: torch.Tensor, ref: TensorRef) -> None:
    offset, nbytes, _, _ = ref
    view = _bytes_of(tensor, nbytes)
    done = 0
    while done < nbytes:  # one write takes at most about 2 GiB
        done += os.pwrite(fd, view[done:], offset + done)


def _read(fd: int, ref: TensorRef) -> torch.Tensor:
    offset, nbytes, dtype, shape = ref
    data = torch.empty(shape, dtype=dtype)
    view = _bytes_of(data, nbytes)
    done = 0
    while done < nbytes:  # one read returns at most about 2 GiB
        read = os.preadv(fd, [view[done:]], offset + done)
        if read == 0:
            raise EOFError(f"shared-memory block ended {nbytes - done} bytes early")
        done += read
    return data


class ReusableBlock:
    """A shared-memory file its writer keeps mapped and rewrites for every message, so messages do
    not each pay for a new file and fresh zeroed pages (see the module docstring for why readers
    never see it rewritten under them). With `max_bytes`, only messages up to that size use it.
    A writer that can no longer tell whether a reader is still copying out (a call that timed out
    or was interrupted) `abandon`s the block (readers have it open or mapped) and the next message
    gets a new one."""

    def __init__(self, prefix: str, max_bytes: int | None = None):
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.name: str | None = None
        self._memory: mmap.mmap | None = None
        self._address = 0  # of the mapping's first byte
        self._anchor: numpy.ndarray | None = None  # holds the mapping's buffer while we use its address

    def takes(self, size: int) -> bool:
        return self.max_bytes is None or size <= self.max_bytes

    def write(self, tensors: list[torch.Tensor], refs: list[TensorRef], size: int) -> str:
        """Copy plain CPU tensors (`_plain_cpu`) to their `refs`; the file name readers open."""
        if self._memory is None or len(self._memory) < size:
            # Grow by at least half, so messages of slightly varying size do not each need a new file.
            grown = 3 * len(self._memory) // 2 if self._memory is not None else 0
            if self.max_bytes is not None:
                grown = min(grown, self.max_bytes)
            size = max(size, 1, grown)
            self.abandon()
            name = f"{self.prefix}-{uuid.uuid4().hex}"
            fd = _create(name, size)
            try:
                self._memory = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.name = name
            self._anchor = numpy.frombuffer(self._memory, dtype=numpy.uint8)
            self._address = self._anchor.ctypes.data
        for t, (offset, nbytes, _, _) in zip(tensors, refs, strict=True):
            if nbytes:
                # One memmove per tensor: its data are contiguous CPU bytes, and the layout fits the mapping.
                ctypes.memmove(self._address + offset, t.data_ptr(), nbytes)
        return self.name

    def abandon(self) -> None:
        """Stop using this file: unlink its name and drop the writer's mapping."""
        if self.name is not None:
            (shm_dir() / self.name).unlink(missing_ok=True)
        self.name = None
        self._anchor, self._address = None, 0
        if self._memory is not None:
            self._memory.close()
        self._memory = None


class ReusedBlockReader:
    """The reading end of another process's `ReusableBlock`: keeps the last block it read mapped,
    so a message in the same block costs one copy per tensor and no system call. A message in
    another block (the writer grew or abandoned it) maps that one instead; `close` drops the mapping."""

    def __init__(self):
        self.name: str | None = None
        self._memory: mmap.mmap | None = None
        self._address = 0
        self._anchor: numpy.ndarray | None = None

    def read(self, packed: Packed) -> list[torch.Tensor]:
        """The tensors of `packed` (whose block is reused), copied into this process's memory."""
        if packed.block != self.name:
            self.close()
            fd = os.open(shm_dir() / packed.block, os.O_RDONLY)
            try:
                self._memory = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self.name = packed.block
            self._anchor = numpy.frombuffer(self._memory, dtype=numpy.uint8)
            self._address = self._anchor.ctypes.data
        tensors = []
        for offset, nbytes, dtype, shape in packed.refs:
            if offset + nbytes > len(self._memory):
                raise EOFError(f"shared-memory block {packed.block} ended before a tensor of {nbytes} bytes")
            tensor = torch.empty(shape, dtype=dtype)
            if nbytes:
                ctypes.memmove(tensor.data_ptr(), self._address + offset, nbytes)
            tensors.append(tensor)
        return tensors

    def close(self) -> None:
        self.name = None
        self._anchor, self._address = None, 0
        if self._memory is not None:
            self._memory.close()
        self._memory = None


def _plain_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values as a contiguous CPU tensor whose memory holds exactly them (no lazy
    conjugate or negative bit): itself when it already is one, which is the common case."""
    if tensor.is_cpu and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg():
        return tensor
    return tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()


def _bytes_of(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The memory of a `_plain_cpu` tensor, as a buffer for a system call."""
    if not nbytes:  # an empty tensor may have no memory at all
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr()))


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
