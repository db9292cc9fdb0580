"""Weight updates one at a time, in the order they come, and no longer than need be.

The engine stages one update at a time and refuses another beside it, so the server's update
routes take turns (`PushTurns.turn`) rather than answer 409. A turn is held while an update is
staged; a streamed push stages as its body arrives, so its turn lasts as long as the body takes.
Alone, that may be up to --upload-timeout-s (a slow link is not refused). While another update
waits, each frame of the holder's body must come within --body-timeout-s of the wait for it (or
of the other update's arrival), else the push is cut off (408) and the next goes: a body that
trickled in a byte at a time held every other trainer's push until its deadline (600 s by default).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator


class PushTurns:
    """The turns of one server's weight updates. `hurried_frame_s`: how long a streamed push may
    wait for each frame of its body while another update waits (--body-timeout-s)."""

    def __init__(self, hurried_frame_s: float):
        self.hurried_frame_s = hurried_frame_s
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._frame_wait: asyncio.Timeout | None = None  # the holder's wait for its next frame, if it waits

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Wait for this update's turn (the holder's frames are hurried meanwhile), and hold it."""
        self._waiting += 1
        self._hurry_holder()
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def frame_due(self, arrive_by: float) -> float:
        """When the holder's next frame must have come (event loop time), its body's deadline being
        `arrive_by`."""
        if not self._waiting:
            return arrive_by
        return min(arrive_by, asyncio.get_running_loop().time() + self.hurried_frame_s)

    @contextlib.contextmanager
    def waiting_for_frame(self, timeout: asyncio.Timeout) -> Iterator[None]:
        """The holder waits for a frame under `timeout`, which an update that comes meanwhile hurries."""
        self._frame_wait = timeout
        try:
            yield
        finally:
            self._frame_wait = None

    def _hurry_holder(self) -> None:
        waiting = self._frame_wait
        if waiting is None:
            return
        hurried = asyncio.get_running_loop().time() + self.hurried_frame_s
        if waiting.when() is None or waiting.when() > hurried:
            waiting.reschedule(hurried)
