"""What admitting a request may take from the server, bounded for all requests together.

Admission runs off the event loop, so that `/health` and every route keep answering, on threads
of its own: its checks (request bodies parsed, params, the engine's `check_requests`) on a few, and
the heavy reads (bodies of tensors parsed, adapter folders read, input images decoded) on fewer.
Both ran on asyncio's default pool: eight generate bodies of 16 PNGs each filled it with decodes,
and a text-only generate waited 57 s behind them for its params check.

Decoded input images are memory a client's bytes did not pay for (a 2 KB PNG holds a 4096 x 4096
image, 50 MB decoded), and they are held until their requests end. `ImageBudget` bounds them for
the whole server: a request takes its images' decoded bytes before they are decoded and gives them
back when its answer ends; one that does not fit waits (first come, first served), and one larger
than the whole budget is a 413 at once. Bounded per request only, eight such bodies took the
server's RSS up 5.9 GB.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import functools
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from fastapi import HTTPException

from rollout.http.wire import decode_images

BUDGET_FLAG = "--input-image-budget-mb"
_CHECK_THREADS = 4
_READ_THREADS = 2  # each decode may take a few hundred MB of PIL's buffers besides its image


class Admission:
    """The threads and the image budget of one server's admission."""

    def __init__(self, image_budget_bytes: int):
        self.images = ImageBudget(image_budget_bytes)
        self._checks = ThreadPoolExecutor(_CHECK_THREADS, thread_name_prefix="rollout-admission")
        self._reads = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="rollout-read")

    async def check(self, fn: Callable, *args) -> Any:
        """`fn(*args)` on the admission's check threads."""
        return await asyncio.get_running_loop().run_in_executor(self._checks, fn, *args)

    async def read(self, fn: Callable, *args) -> Any:
        """`fn(*args)` on the admission's threads for heavy reads (bodies, folders, image decodes)."""
        return await asyncio.get_running_loop().run_in_executor(self._reads, fn, *args)

    async def decode(self, named: list[list[tuple[str, torch.Tensor]]]) -> list[list[torch.Tensor] | None]:
        """`rollout.http.wire.decode_images` on the read threads, then the heap's free memory given
        back to the system: a decode's buffers (PIL's image, its RGB copy, the pixels' bytes: ~170
        MB beside a 4096 x 4096 image's 48) stayed in the threads' malloc arenas, 2.2 GB after
        eight bodies of them were refused."""
        return await self.read(_decode_and_trim, named)


def _decode_and_trim(named: list[list[tuple[str, torch.Tensor]]]) -> list[list[torch.Tensor] | None]:
    images = decode_images(named)
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return images


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where the C library has it (not macOS's, nor musl's)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except AttributeError:
        return None


class ImageBudget:
    """Bytes of decoded input images held by requests being admitted or served, at most `limit`."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, where shares are taken

    async def take(self, nbytes: int) -> Share:
        """A share of `nbytes`, once it fits beside the others (a 413 if it never can); give it back
        with `Share.give_back`, which a share dropped unreturned does too."""
        if nbytes > self.limit:
            raise HTTPException(
                413,
                f"the request's input images take {nbytes / 2**20:.3g} MiB decoded, over this server's budget of "
                f"{self.limit / 2**20:.3g} MiB for the input images of all its requests together ({BUDGET_FLAG}); "
                "send fewer or smaller images (or raise the budget)",
            )
        self._loop = asyncio.get_running_loop()
        if not self._waiting and self.held + nbytes <= self.limit:
            self.held += nbytes
        else:
            granted = asyncio.get_running_loop().create_future()
            self._waiting.append((nbytes, granted))
            try:
                await granted
            except asyncio.CancelledError:  # the client left while it waited
                if granted.done() and not granted.cancelled():
                    self._returned(nbytes)  # granted as it was cancelled
                self._grant()
                raise
        return Share(self, nbytes)

    def give_back(self, nbytes: int) -> None:
        """Return `nbytes` taken before, from any thread (a share may be collected in another)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is self._loop:
            self._returned(nbytes)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._returned, nbytes)

    def _returned(self, nbytes: int) -> None:
        self.held -= nbytes
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            nbytes, granted = self._waiting[0]
            if granted.done():  # its caller left
                self._waiting.popleft()
            elif self.held + nbytes <= self.limit:
                self._waiting.popleft()
                self.held += nbytes
                granted.set_result(None)
            else:
                return


class Share:
    """Bytes taken from an `ImageBudget`; `give_back()` returns them (once, whoever calls first)."""

    def __init__(self, budget: ImageBudget, nbytes: int):
        # Also when the share is dropped unreturned (an answer's stream never started): the budget
        # must not shrink for good.
        self._finalizer = weakref.finalize(self, budget.give_back, nbytes)

    def give_back(self) -> None:
        self._finalizer()
