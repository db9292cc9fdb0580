"""Fault a fresh memory mapping's pages in on a thread of its own, a bounded way ahead of the thread
that fills it.

The first write to each page of a new mapping faults, and the kernel zeroes the page. In this VM
that was most of the cost of receiving a streamed push: the event loop copying 1 GB into fresh
frame buffers spent ~3.5 s of CPU there, against ~0.8 s for a sink that only reads the same body;
filling 1 GB of fresh memory alone took 2.0 s, 0.15 s with the pages faulted in by another thread
meanwhile. `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) faults them in as a write would without
changing what a page holds, so it may run while the buffer is being filled; ctypes releases the
GIL for the call. Elsewhere (another OS, an older kernel) nothing is done and the filling thread
takes the faults as before.

The thread stays at most as far past what has been written as has been written (`advance`; 4 MiB
at first, `ahead_bytes` at most): faulting in a whole buffer at once made memory of what a peer
only announced (a push frame's header claiming 8 GiB took 8 GiB before a byte of it came).
`release` stops the thread and gives the pages back at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import sys
import threading

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # <asm-generic/mman-common.h>; Python's mmap module does not name it before 3.13
_STEP_BYTES = 4 << 20  # faulted in per call, so that `release` waits for one call at most
_FIRST_BYTES = 4 << 20  # faulted in before the first byte comes


class PagePrefault:
    """Faults `buffer`'s pages (an anonymous mapping) in on a daemon thread, up to `ahead_bytes`
    past the last `advance(written)`; the thread ends at the buffer's end or at `release()`."""

    def __init__(self, buffer: mmap.mmap, ahead_bytes: int):
        self._buffer, self._ahead_bytes = buffer, ahead_bytes
        self._target = min(len(buffer), _FIRST_BYTES)  # fault in up to here
        self._wanted = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        if sys.platform.startswith("linux") and len(buffer):
            address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # the export ends with the statement
            self._thread = threading.Thread(target=self._run, args=(address,), name="rollout-prefault", daemon=True)
            self._thread.start()

    def advance(self, written: int) -> None:
        """`written` bytes of the buffer are filled: fault in as many again past them, at least
        4 MiB and at most `ahead_bytes`, so what a sender costs grows with what it sent."""
        target = min(len(self._buffer), written + min(max(written, _FIRST_BYTES), self._ahead_bytes))
        if self._thread is None or target < min(self._target + _STEP_BYTES, len(self._buffer)):
            return  # not a step further yet: no lock taken for each read from the socket
        with self._wanted:
            if target > self._target:
                self._target = target
                self._wanted.notify()

    def release(self) -> None:
        """Stop faulting in and free the buffer's pages now (its contents are lost), rather than
        when the last reference to it goes (a traceback that holds it may keep it for a while)."""
        with self._wanted:
            self._stopped = True
            self._wanted.notify()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(ValueError):  # already closed
            self._buffer.madvise(mmap.MADV_DONTNEED)
        with contextlib.suppress(BufferError):  # a view of it is still alive somewhere: the pages are gone anyway
            self._buffer.close()

    def _run(self, address: int) -> None:
        done = 0
        while True:
            with self._wanted:
                while not self._stopped and done >= self._target:
                    self._wanted.wait()
                if self._stopped:
                    return
                end = min(self._target, done + _STEP_BYTES)
            if _libc().madvise(address + done, end - done, _MADV_POPULATE_WRITE) != 0:
                errno = ctypes.get_errno()
                logger.debug("MADV_POPULATE_WRITE refused (errno %s): pages fault in as they are written", errno)
                return
            done = end
            if done == len(self._buffer):
                return


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
