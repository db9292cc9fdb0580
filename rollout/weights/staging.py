"""Staging buffers: where a pushed bucket is written once and then becomes the worker's weights.

A bucket of `update_weights` is one flat buffer (`BucketLayout`: every tensor at an aligned offset,
in its target dtype). The worker owns the buffers (`StagingPool`) and hands the engine a
`StagingHandle` for each bucket: in its own process (`uni`) the buffer itself; in another process
on the same host (`mp`, a local `ray` actor) the name of a shared-memory file the engine maps
(`EngineMaps`). The engine copies the caller's tensors straight into it (the push's one copy,
with the NaN/inf check on the bytes just written), and the worker takes views of it as its staged
and then live weights: no wire format, no second copy.

Ownership: the engine writes a buffer only between its reservation and the staging of its bucket;
the caller's tensors are read during `update_weights` and never kept. A buffer is handed out again
only when its storage is referenced by the pool alone (no live weight, no staged or rolled-back
tensor and no caller of a worker function keeps a view of it), so the memory that serves sampling
is never written. The price: besides the live weights the worker keeps the previous version's
buffers for the next push (twice the pushed bytes while pushes go on; `trim` drops what a push did
not reuse, `release` drops every free buffer).
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.weights.state import TensorSpec, all_finite

ALIGN = 64  # bytes: every tensor of a bucket starts on a cache line

# One tensor of a bucket: (name, byte offset, dtype, shape).
Entry = tuple[str, int, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor of a bucket lies in its flat buffer (dtypes are the targets')."""

    entries: tuple[Entry, ...]
    nbytes: int

    @classmethod
    def of(cls, specs: list[tuple[str, TensorSpec]]) -> BucketLayout:
        entries, offset = [], 0
        for name, spec in specs:
            entries.append((name, offset, spec.dtype, spec.shape))
            offset += -(-spec.nbytes // ALIGN) * ALIGN
        return cls(tuple(entries), offset)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> a view of `flat` (uint8, at least `nbytes`) in the tensor's dtype and shape.
        One `as_strided` per tensor over a typed view of the whole buffer per dtype: a third of
        the cost of slicing and viewing each (a few ms a push for a model of hundreds of tensors)."""
        typed: dict[torch.dtype, torch.Tensor] = {}
        views = {}
        for name, offset, dtype, shape in self.entries:
            whole = typed.get(dtype)
            if whole is None:  # every offset is ALIGN-aligned, so a whole element of every dtype
                whole = typed[dtype] = flat[: flat.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
            strides, step = [], 1
            for size in reversed(shape):
                strides.append(step)
                step *= size
            views[name] = whole.as_strided(shape, strides[::-1], whole.storage_offset() + offset // dtype.itemsize)
        return views


def write_bucket(
    targets: list[torch.Tensor],
    layout: BucketLayout,
    tensors: list[torch.Tensor],
    check_finite: bool,
    checker: ThreadPoolExecutor | None = None,
) -> list[str]:
    """Copy `tensors` (in `layout`'s order) into the first of `targets` (uint8 buffers), converting
    to the target dtype, then the whole bucket into every further one; returns the names of those
    holding NaN or infinity. The check sums the tensors of every few MiB just copied, while their
    bytes are still in cache (a second pass over the bucket would read it all from memory again),
    on the `checker` thread if given (beside the copy of the next ones), and looks at all the sums
    at once; only a tensor whose sum is not finite is looked at element by element (a finite
    tensor whose sum overflows is not refused)."""
    views = layout.views(targets[0])
    chunks: list[Future] = []  # each resolves to (name, sum) of its tensors
    chunk, chunk_bytes = [], 0
    with torch.no_grad():
        for (name, *_), tensor in zip(layout.entries, tensors, strict=True):
            view = views[name]
            view.copy_(tensor.detach())
            if check_finite and view.is_floating_point() and view.numel():
                chunk.append((name, view))
                chunk_bytes += view.nbytes
                if chunk_bytes >= CHECK_CHUNK_BYTES:
                    chunks.append(_summed(chunk, checker))
                    chunk, chunk_bytes = [], 0
        if chunk:
            chunks.append(_summed(chunk, checker))
        sums = [pair for future in chunks for pair in future.result()]
        problems = []
        if sums:
            suspects = (~torch.isfinite(torch.stack([total for _, total in sums]))).nonzero().flatten().tolist()
            problems = [
                f"{sums[i][0]}: holds NaN or infinite values" for i in suspects if not all_finite(views[sums[i][0]])
            ]
        if not problems:
            for target in targets[1:]:  # every further rank: one flat copy of the checked bucket
                target.copy_(targets[0])
    return problems


# Bytes copied before their sums are taken: a few MiB, so they are still in the last-level cache.
CHECK_CHUNK_BYTES = 4 * 2**20


def _summed(chunk: list[tuple[str, torch.Tensor]], checker: ThreadPoolExecutor | None) -> Future:
    """(name, sum) of each tensor of `chunk`, on `checker` if given, else here and now."""
    if checker is not None:
        return checker.submit(_sums, chunk)
    future = Future()
    future.set_result(_sums(chunk))
    return future


def _sums(chunk: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    with torch.no_grad():
        return [(name, view.sum()) for name, view in chunk]


@dataclass(frozen=True)
class StagingHandle:
    """How the engine reaches a reserved buffer: `flat` itself in the worker's process, else the
    shared-memory file `path` (identified by its inode, so another host's file of the same name
    is not taken for it); neither when the worker could not share one (the bucket then travels
    through the executor's transport)."""

    nbytes: int
    flat: torch.Tensor | None = None
    path: str | None = None
    inode: int = 0


class _Buffer:
    def __init__(self, nbytes: int, shared: bool, device: torch.device):
        self.nbytes = nbytes
        self.device = torch.device("cpu") if shared else device
        self.path: str | None = None
        self.inode = 0
        self.last_push = 0
        if shared:
            self.path, self.inode = _shared_file(nbytes)
        if self.path is not None:
            self.flat = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
        else:  # on the model's device: an in-process engine writes straight into it
            self.flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.flat.zero_()  # every page touched now, not in the timed write of the first push

    def is_free(self) -> bool:
        # The pool's own reference and the temporary storage object: nothing else views it.
        return torch._C._storage_Use_Count(self.flat.untyped_storage()._cdata) <= 2

    def handle(self, in_process: bool) -> StagingHandle:
        if in_process:
            return StagingHandle(self.nbytes, flat=self.flat)
        return StagingHandle(self.nbytes, path=self.path, inode=self.inode)

    def drop(self) -> None:
        if self.path is not None:
            Path(self.path).unlink(missing_ok=True)


def _shared_file(nbytes: int) -> tuple[str | None, int]:
    """A new shared-memory file of `nbytes` (space reserved: a full /dev/shm is (None, 0), and the
    bucket goes through the transport, never a SIGBUS later); named for this process, so an engine
    started after it died removes it (`executors.shm.remove_stale_blocks`)."""
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = folder / f"rollout-{os.getpid()}-staging-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        os.posix_fallocate(fd, 0, max(nbytes, 1))
        return str(path), os.fstat(fd).st_ino
    except OSError as error:
        path.unlink(missing_ok=True)
        if error.errno != errno.ENOSPC:
            raise
        return None, 0
    finally:
        os.close(fd)


class StagingPool:
    """A worker's staging buffers. `reserve` hands out one per bucket of a push (a free one of the
    right size, else a new one), `take` gives the staging of the next bucket its buffer, in order."""

    def __init__(self):
        self._buffers: list[_Buffer] = []
        self._reserved: list[_Buffer] = []
        self._push = 0

    def reserve(self, sizes: list[int], shared: bool, in_process: bool, device: torch.device) -> list[StagingHandle]:
        """A buffer per bucket (`sizes`: bytes): in a shared-memory file with `shared`, else on
        `device` (the model's: the engine's write is then the only copy, on a GPU too)."""
        handles = []
        device = torch.device("cpu") if shared else torch.device(device)
        for nbytes in sizes:
            buffer = next((b for b in self._buffers if self._fits(b, nbytes, shared, device)), None)
            if buffer is None:
                buffer = _Buffer(nbytes, shared, device)
                self._buffers.append(buffer)
            buffer.last_push = self._push
            self._reserved.append(buffer)
            handles.append(buffer.handle(in_process))
        return handles

    def _fits(self, buffer: _Buffer, nbytes: int, shared: bool, device: torch.device) -> bool:
        return (
            buffer.nbytes == nbytes
            and (buffer.path is not None) == shared
            and buffer.device == device
            and buffer not in self._reserved
            and buffer.is_free()
        )

    def take(self, nbytes: int) -> torch.Tensor:
        """The buffer reserved first and not yet taken (its bytes, as the engine wrote them)."""
        if not self._reserved or self._reserved[0].nbytes != nbytes:
            raise RuntimeError(f"no staging buffer of {nbytes} bytes reserved: reserve_staging first")
        return self._reserved.pop(0).flat

    def cancel(self) -> None:
        """Forget the reservations not taken (the push was dropped)."""
        self._reserved.clear()
        self._push += 1

    def trim(self) -> None:
        """The push was applied: drop the free buffers neither it nor the one before used (a push
        of other sizes)."""
        keep = []
        for buffer in self._buffers:
            if buffer.last_push < self._push - 1 and buffer.is_free() and buffer not in self._reserved:
                buffer.drop()
            else:
                keep.append(buffer)
        self._buffers = keep
        self._reserved.clear()
        self._push += 1

    def close(self) -> None:
        """Remove the shared files (the worker is ending; mappings stay valid until they are dropped)."""
        for buffer in self._buffers:
            buffer.drop()

    def release(self) -> None:
        """Drop every free buffer (sleep, shutdown)."""
        self._reserved.clear()
        keep = []
        for buffer in self._buffers:
            if buffer.is_free():
                buffer.drop()
            else:
                keep.append(buffer)
        self._buffers = keep


class EngineMaps:
    """The engine's mappings of the workers' shared staging files, kept while the workers keep
    the files (a push maps each file once; later pushes reuse the mapping and its touched pages)."""

    def __init__(self):
        self._maps: dict[str, torch.Tensor] = {}

    def writable(self, handle: StagingHandle) -> torch.Tensor | None:
        """The buffer of `handle` as a uint8 tensor this process may write, or None when it is
        not reachable from here (another host, or the worker shares none)."""
        if handle.flat is not None:
            return handle.flat
        if handle.path is None:
            return None
        flat = self._maps.get(handle.path)
        if flat is None:
            try:
                if os.stat(handle.path).st_ino != handle.inode:
                    return None
            except FileNotFoundError:
                return None
            flat = self._maps[handle.path] = torch.from_file(
                handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8
            )
        return flat

    def keep_only(self, paths: set[str]) -> None:
        """Unmap the files not in `paths` (those the workers dropped, or will not hand out again)."""
        for path in [p for p in self._maps if p not in paths]:
            del self._maps[path]
