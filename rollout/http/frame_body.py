"""The body of a streamed weight push as the server's HTTP protocol reads it: from the socket
straight into the frames' buffers (`ChunkedFrameReader`), handed to the route as whole frames.

The protocol (`rollout.http.protocol`) makes one for a chunked request to a route that takes
a frame stream, and puts it in the request's ASGI scope under `FRAME_BODY_EXTENSION`; the HTTP
parser then sees only the request's head and, at the end, the last chunk and its trailers. The
route takes the frames with `frames(limit, ...)`, under the same limits as any body
(`rollout.http.request_body`): 413 past `limit` bytes, 408 when the client stalls for
`idle_timeout_s` while a frame is awaited, 400 when it goes away or breaks the chunked framing.

Reading is pulled by the route: the socket is read while the route waits for a frame and paused
once the frame is complete, so the server holds what the route holds plus one frame in progress,
as with uvicorn's own flow control. A body the route leaves unread (its request answered early:
a refused key, an engine that refused the update) is read to its end and dropped once the answer
is sent, so that the client, which sends the whole body before it reads, gets the answer; a body
whose framing broke cannot be so read, and its connection is closed after the answer.
"""

from __future__ import annotations

import asyncio
import mmap
from collections import deque
from collections.abc import AsyncIterator, Callable

from fastapi import HTTPException
from uvicorn.protocols.http.flow_control import FlowControl

from rollout.http.chunked_frames import ChunkedFrameReader, MalformedChunks
from rollout.http.frame_views import FrameAssembler
from rollout.http.request_body import client_went_away, stalled, too_big
from rollout.http.wire import WireError

FRAME_BODY_EXTENSION = "rollout.frame_body"
_SPARE_READ_BYTES = 64 << 10


class FrameBody:
    """One request's frame stream. `ended(tail, after)` is the protocol's: it gets the last
    chunk's line and trailers for the HTTP parser and the bytes read past them, and calls
    `close(accepted)` once the parser has taken the tail."""

    def __init__(self, loop: asyncio.AbstractEventLoop, flow: FlowControl, max_tail_bytes: int, ended: Callable):
        self._loop, self._flow, self._ended = loop, flow, ended
        self._first = bytearray()  # bytes that came with the head, or before the route asked
        self._max_tail_bytes = max_tail_bytes
        self._reader: ChunkedFrameReader | None = None  # made when the route asks, with its limits
        self._limit, self._flag, self._idle_timeout_s = 0, "", 0.0
        self._ready: deque[bytearray | mmap.mmap] = deque()  # complete, not yet taken
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self._error: BaseException | None = None
        self._at_end = False  # the parser took the tail: no frame follows the ones ready
        self._draining = False  # the request is answered: the rest of the body is read and dropped
        self.framing_lost = False  # where the body ends is unknown: the connection must close
        self.finished = False  # the protocol reads no more of it
        self._spare = memoryview(bytearray(_SPARE_READ_BYTES))  # reads with no frame to go to
        self._set_reading()  # off until the route asks for a frame

    # The route's side.

    async def frames(self, limit: int, flag: str, idle_timeout_s: float) -> AsyncIterator[bytearray | mmap.mmap]:
        """Each frame's buffer as it completes. Raises HTTPException (400, 408, 413; `flag` is the
        command-line flag that sets `limit`) or WireError (the body ended inside a frame)."""
        self._limit, self._flag, self._idle_timeout_s = limit, flag, idle_timeout_s
        self._start(ChunkedFrameReader(FrameAssembler(limit), limit, self._max_tail_bytes))
        while True:
            if self._ready:
                yield self._ready.popleft()
            elif self._error is not None:
                raise self._error
            elif self._at_end:
                return
            else:
                await self._wait()

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        self._last_read = self._loop.time()
        self._timer = self._loop.call_at(self._last_read + self._idle_timeout_s, self._check_stalled)
        self._set_reading()
        try:
            await self._waiter
        finally:
            self._waiter = None
            self._timer.cancel()

    def _check_stalled(self) -> None:
        if self._loop.time() - self._last_read < self._idle_timeout_s:
            self._timer = self._loop.call_at(self._last_read + self._idle_timeout_s, self._check_stalled)
            return
        size = self._reader.data_bytes if self._reader is not None else 0
        self._fail(stalled(self._idle_timeout_s, size))

    # The protocol's side.

    def add_early_bytes(self, data: memoryview) -> None:
        """Bytes of the body that were read with the request's head."""
        self._first += data

    def get_buffer(self) -> memoryview:
        return self._reader.get_buffer() if self._reader is not None and not self.framing_lost else self._spare

    def buffer_updated(self, nbytes: int) -> None:
        self._last_read = self._loop.time()
        if self._reader is None:  # something else resumed reading (uvicorn's receive)
            self._first += self._spare[:nbytes]
            self._set_reading()
        elif not self.framing_lost:
            self._read(lambda reader: reader.buffer_updated(nbytes))

    def discard(self) -> None:
        """The request is answered: read the rest of the body and drop it."""
        if self._reader is None:
            reader = ChunkedFrameReader(FrameAssembler(0), float("inf"), self._max_tail_bytes)
            reader.discarding = True
            self._start(reader)
        self._reader.discarding, self._draining = True, True
        self._reader.assembler.release()
        self._ready.clear()
        self._set_reading()

    def close(self, accepted: bool) -> None:
        """The protocol reads no more of the body: the HTTP parser took its tail, or refused it."""
        self.finished = True
        if not accepted:
            self._fail(MalformedChunks("the HTTP parser refused the body's last chunk or trailers"), framing_lost=True)
            return
        try:
            self._reader.assembler.close()
        except WireError as error:
            self._fail(error)
        self._at_end = True
        self._wake()

    def connection_lost(self) -> None:
        self.finished = True
        if self._error is None:
            size = self._reader.data_bytes if self._reader is not None else 0
            self._fail(client_went_away(size), framing_lost=True)

    def _start(self, reader: ChunkedFrameReader) -> None:
        self._reader = reader
        first, self._first = self._first, bytearray()
        self._read(lambda reader: reader.feed(first))

    def _read(self, step: Callable[[ChunkedFrameReader], list]) -> None:
        try:
            frames = step(self._reader)
        except MalformedChunks as error:
            self._fail(HTTPException(400, f"the request body's chunked framing is broken: {error}"), framing_lost=True)
            return
        if self._reader.refused is not None:  # the reader drops the rest, and finds the body's end
            self._fail(too_big(self._limit, self._flag))
        if frames and not self._reader.discarding:
            self._ready.extend(frames)
            self._wake()
        if self._reader.done and not self.finished:  # (the connection may be gone before the route asked)
            self._ended(self._reader.tail, bytes(self._reader.after))

    def _fail(self, error: BaseException, framing_lost: bool = False) -> None:
        if self._error is None:
            self._error = error
        self.framing_lost = self.framing_lost or framing_lost
        if self._reader is not None:
            self._reader.discarding = True  # the route stops at the error: what follows is dropped
            self._reader.assembler.release()  # now: the error's traceback may hold this body a while
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._set_reading()

    def _set_reading(self) -> None:
        # The socket is read while the route waits for a frame, or while the body is drained; once
        # the body is read, reading is uvicorn's again.
        if self.finished:
            return
        waited = self._waiter is not None and not self._waiter.done()
        if waited or self._draining:
            self._flow.resume_reading()
        else:
            self._flow.pause_reading()
