"""Fault a fresh memory mapping's pages in on a thread of its own, a bounded distance ahead of the
thread that fills it.

The first write to each page of a new mapping faults, and the kernel zeroes the page. In this VM
that was most of the cost of receiving a streamed push: the event loop copying 1 GB into fresh
frame buffers spent ~3.5 s of CPU there, against ~0.8 s for a sink that only reads the same body;
filling 1 GB of fresh memory alone took 2.0 s, 0.15 s with the pages faulted in by another thread
meanwhile. `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) faults them in as a write would without
changing what a page holds, so it may run while the buffer is being filled; ctypes releases the
GIL for the call. Elsewhere (another OS, an older kernel) nothing is done and the filling thread
takes the faults as before.

The pages faulted in are memory a peer's bytes have not paid for yet, so they stay within `ahead`
bytes of what has been written: the first `ahead` at once, then the window moves with `advance`,
a quarter of it per call. Faulting the rest of a frame in once its first eighth had come held a
whole announced frame (1 GiB in a probe, up to --max-upload-mb) for a sender that stopped there,
until the push's deadline. `release` gives the pages back at once.
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
_STEPS_PER_WINDOW = 4
# A faulting thread that is not asked for more for this long ends (a frame whose sender went quiet,
# or one dropped unreleased); the filling thread then takes the faults of what comes, as without it.
_IDLE_END_S = 120.0


class PagePrefault:
    """Keeps the pages of `buffer` (an anonymous mapping) faulted in up to `ahead` bytes past what
    has been written, on a daemon thread: `advance(written)` reports the bytes filled, `release()`
    frees the pages."""

    def __init__(self, buffer: mmap.mmap, ahead: int):
        self._buffer = buffer
        self._ahead = max(ahead, mmap.PAGESIZE)
        self._step = max(self._ahead // _STEPS_PER_WINDOW, mmap.PAGESIZE)
        self._window = _Window(_pages(self._ahead, len(buffer)))
        if sys.platform.startswith("linux"):
            address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # the export ends here
            # The thread holds the address, never the buffer: a buffer dropped unreleased is still freed.
            args = (self._window, address, len(buffer))
            threading.Thread(target=_fault_in, args=args, name="rollout-prefault", daemon=True).start()

    def advance(self, written: int) -> None:
        """`written` bytes of the buffer are filled."""
        window = self._window
        if written + self._ahead < window.wanted + self._step or window.wanted >= len(self._buffer):
            return  # the window has not moved by a step yet
        with window.changed:
            window.wanted = _pages(written + self._ahead, len(self._buffer))
            window.changed.notify()

    def release(self) -> None:
        """Free the buffer's pages now (its contents are lost), rather than when the last reference
        to it goes (a traceback that holds it may keep it for a while). Waits for a madvise call
        in progress (a quarter of the window at most), so that none runs on a closed mapping."""
        window = self._window
        with window.changed:
            window.released = True
            window.changed.notify_all()
            window.changed.wait_for(lambda: not window.calling)
        with contextlib.suppress(ValueError):  # already closed
            self._buffer.madvise(mmap.MADV_DONTNEED)
        with contextlib.suppress(BufferError):  # a view of it is still alive somewhere: the pages are gone anyway
            self._buffer.close()


class _Window:
    """What the faulting thread shares with its `PagePrefault`, under `changed`."""

    def __init__(self, wanted: int):
        self.changed = threading.Condition()
        self.wanted = wanted  # faulted in, or to be, up to this byte
        self.released = False
        self.calling = False  # a madvise call runs: the mapping must stay open until it returns


def _fault_in(window: _Window, address: int, length: int) -> None:
    done = 0
    while done < length:
        with window.changed:
            while not window.released and done >= window.wanted:
                if not window.changed.wait(_IDLE_END_S):
                    return
            if window.released:
                return
            end, window.calling = window.wanted, True
        try:
            refused = _libc().madvise(address + done, end - done, _MADV_POPULATE_WRITE) != 0
        finally:
            with window.changed:
                window.calling = False
                window.changed.notify_all()
        if refused:
            errno = ctypes.get_errno()
            logger.debug("MADV_POPULATE_WRITE refused (errno %s): pages fault in as they are written", errno)
            return
        done = end


def _pages(end: int, length: int) -> int:
    """`end` rounded up to a whole page (madvise takes whole pages), at most `length`."""
    return min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, length)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
