"""Fault a fresh memory mapping's pages in on a thread of its own, ahead of the thread that fills it,
once some of it has been filled.

The first write to each page of a new mapping faults, and the kernel zeroes the page. In this VM
that was most of the cost of receiving a streamed push: the event loop copying 1 GB into fresh
frame buffers spent ~3.5 s of CPU there, against ~0.8 s for a sink that only reads the same body;
filling 1 GB of fresh memory alone took 2.0 s, 0.15 s with the pages faulted in by another thread
meanwhile. `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) faults them in as a write would without
changing what a page holds, so it may run while the buffer is being filled; ctypes releases the
GIL for the call. Elsewhere (another OS, an older kernel) nothing is done and the filling thread
takes the faults as before.

Faulting a whole buffer in at once made memory of what a peer only announced (a push frame's header
claiming 8 GiB took 8 GiB before a byte of it came). So its first `start_after` bytes are faulted
in at once, and the rest only once they have been written (`advance`), in one call from the page
being written: one call, so that the filling thread never takes the GIL back from it between
steps. `release` gives the pages back at once (a call still running frees what it faulted in as it
ends).
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


class PagePrefault:
    """Faults the pages of `buffer` (an anonymous mapping) in on daemon threads: its first
    `start_after` bytes at once, the rest once `advance(written)` reaches `start_after`;
    `release()` frees them."""

    def __init__(self, buffer: mmap.mmap, start_after: int):
        self._buffer, self._start_after = buffer, start_after
        self._lock = threading.Lock()
        self._started, self._released = False, False
        self._populating = 0  # calls running
        self._populate(0, start_after)

    def advance(self, written: int) -> None:
        """`written` bytes of the buffer are filled."""
        if self._started or written < self._start_after:
            return
        self._started = True
        self._populate(written - written % mmap.PAGESIZE, len(self._buffer))  # madvise takes whole pages

    def release(self) -> None:
        """Free the buffer's pages now (its contents are lost), rather than when the last reference
        to it goes (a traceback that holds it may keep it for a while)."""
        with self._lock:
            self._released = True
            populating = self._populating
        _free(self._buffer)  # what is there now; a call that runs frees what it faulted in as it ends
        if not populating:
            with contextlib.suppress(BufferError):  # a view of it is still alive somewhere: the pages are gone anyway
                self._buffer.close()

    def _populate(self, start: int, end: int) -> None:
        end = min(end, len(self._buffer))
        if start >= end or not sys.platform.startswith("linux"):
            return
        with self._lock:
            self._populating += 1
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._buffer))  # the export ends here
        args = (address + start, end - start)
        threading.Thread(target=self._run, args=args, name="rollout-prefault", daemon=True).start()

    def _run(self, address: int, length: int) -> None:
        if _libc().madvise(address, length, _MADV_POPULATE_WRITE) != 0:
            errno = ctypes.get_errno()
            logger.debug("MADV_POPULATE_WRITE refused (errno %s): pages fault in as they are written", errno)
        with self._lock:
            self._populating -= 1
            last = self._released and not self._populating
        if last:  # released while this ran: the buffer is closed here, once no call uses it
            _free(self._buffer)
            with contextlib.suppress(BufferError):
                self._buffer.close()


def _free(buffer: mmap.mmap) -> None:
    with contextlib.suppress(ValueError):  # already closed
        buffer.madvise(mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
