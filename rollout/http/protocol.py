"""uvicorn's HTTP/1.1 protocol on httptools' C parser, plus bounds on the time and the bytes a
connection may take to send a request's headers, and a reader of its own for the chunked bodies
of streamed weight pushes.

The parser: with uvicorn's pure-Python h11 protocol the server's event loop was saturated at about
300-540 MB/s of request body on loopback, short of a full-weight push's 1 GB/s; httptools (llhttp,
in C) is uvicorn's other protocol, and a dependency of the project so that every server runs it.
A body's bytes also skip uvicorn's two copies of them where they can (`on_body`).

The bounds: uvicorn closes an idle kept-alive connection after its keep-alive timeout, but a
connection that is opened and sends nothing, or half a request, stays open until the client goes
away: 50 such connections held their sockets past 75 s, before any key was checked. Here a
connection must finish a request's headers within `header_timeout_s` of connecting, or of sending
the first bytes of its next request; otherwise it is closed. An idle kept-alive connection (nothing
sent since its last answer) is left to uvicorn's keep-alive timeout, so clients can reuse their
connections. h11 refused headers over 16 KiB; llhttp has no such limit (and uvicorn keeps every
header in memory), so a request whose URL and headers run past `max_header_bytes` is answered 400
and its connection closed.

The weight pushes: a chunked frame-stream body (Content-Type FRAMES_MEDIA_TYPE) posted to one of
`frame_body_paths` is read by `rollout.http.frame_body`, from the socket straight into its frames'
buffers, and the route takes it from the request's ASGI scope; httptools sees the request's head
and, once the body has ended, its last chunk and trailers. On httptools alone every byte was copied
three times on the event loop's thread (into the bytes `data_received` gets, into the bytes of each
`on_body` piece, into the frame): a push cost that thread 1.6-1.9 s of CPU per GB, 0.7-1.2 s
read this way (`benchmarks/http_weight_push` at 0.22 and 1 GB, on a loaded machine; a sink that
only reads the body through httptools, 0.8-1.0 s). So the protocol is a `BufferedProtocol`:
asyncio reads into the buffer that `get_buffer` offers, which is the frame's while a frame body is
read, and a buffer of the protocol's otherwise, whose bytes go to httptools as before. A request
head is handed to httptools up to its blank line and no further, so that the parser never reads
into a body that is not its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rollout.http.frame_body import FRAME_BODY_EXTENSION, FrameBody
from rollout.http.wire import FRAMES_MEDIA_TYPE

logger = logging.getLogger(__name__)

_HEAD_END = b"\r\n\r\n"
_READ_BYTES = 256 << 10  # asyncio's own read size for `data_received`


def server_protocol(header_timeout_s: float, frame_body_paths: Iterable[str] = ()) -> type[HttpToolsProtocol]:
    """The protocol class to give `uvicorn.Config(http=...)`; `frame_body_paths` are the routes
    whose chunked frame-stream bodies it reads itself (`rollout.http.frame_body`)."""
    fields = {"header_timeout_s": header_timeout_s, "frame_body_paths": frozenset(frame_body_paths)}
    return type("RolloutHttpProtocol", (ServerProtocol,), fields)


class ServerProtocol(HttpToolsProtocol, asyncio.BufferedProtocol):
    header_timeout_s = 10.0
    max_header_bytes = 64 << 10  # an API key and a few headers need ~1 KiB
    frame_body_paths: frozenset[str] = frozenset()
    _deadline: asyncio.TimerHandle | None = None
    _in_headers = False  # the parser is inside a request's URL or headers
    _header_bytes = 0  # received of them, counted before httptools parses them (`_received`)
    _frame_body: FrameBody | None = None  # the body being read into frames, if one is
    _head_seen = b""  # the last bytes of a head whose end is being looked for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_buffer = memoryview(bytearray(_READ_BYTES))
        self._arm()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_buffer if self._frame_body is None else self._frame_body.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self._frame_body is None:
            self._received(self._read_buffer[:nbytes])
        else:
            self._unset_keepalive_if_required()  # as `data_received` does: the client is sending
            self._frame_body.buffer_updated(nbytes)

    def _received(self, data: memoryview) -> None:
        """Bytes for httptools, up to the end of a request head that starts a frame body, whose
        bytes these are from there on."""
        while data and not self.transport.is_closing():
            if self._in_headers or not self._request_in_progress():
                end = self._head_end(data)
                if not self._in_headers:  # a request's head starts here
                    self._header_bytes = 0
                self._header_bytes += end
                if self._header_bytes > self.max_header_bytes:  # the head's whole block: line, headers, blank line
                    self._refuse_long_head()
                    return
            else:  # a body's bytes, for httptools: a head after them is one queued behind this request
                end, self._head_seen = len(data), b""
            self.data_received(data[:end])
            data = data[end:]
            if self._frame_body is not None:
                self._frame_body.add_early_bytes(data)
                return

    def _head_end(self, data: memoryview) -> int:
        """Where in `data` the request head being read ends (after its blank line), or len(data).
        The head may have begun in bytes read before: their last three are kept."""
        window = self._head_seen + bytes(data[:3])
        found = window.find(_HEAD_END)
        if found >= 0:
            found -= len(self._head_seen)
            self._head_seen = b""
            return found + len(_HEAD_END)
        found = bytes(data[: self.max_header_bytes + len(_HEAD_END)]).find(_HEAD_END)
        if found >= 0:
            self._head_seen = b""
            return found + len(_HEAD_END)
        self._head_seen = (self._head_seen + bytes(data[-3:]))[-3:]
        return len(data)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_in_progress():  # its headers are all here: the time bound is met
            self._disarm()
        else:  # the bytes of a request whose headers are not all here
            self._arm()

    def _refuse_long_head(self) -> None:
        # Before httptools sees the bytes: a head that ends past the limit is never dispatched.
        logger.info("refused a request whose headers ran past %s bytes", self.max_header_bytes)
        self.send_400_response(
            f"The request's URL and headers are over this server's limit of {self.max_header_bytes} bytes."
        )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True

    def on_headers_complete(self) -> None:
        self._in_headers = False
        starts_now = self.cycle is None or self.cycle.response_complete  # not queued behind another
        super().on_headers_complete()
        if starts_now and self._takes_frame_body():
            self._frame_body = FrameBody(self.loop, self.flow, self.max_header_bytes, self._frame_body_ended)
            self.scope["extensions"] = {FRAME_BODY_EXTENSION: self._frame_body}

    def _takes_frame_body(self) -> bool:
        if self.scope["method"] != "POST" or self.scope.get("path") not in self.frame_body_paths:
            return False
        headers = dict(self.headers)
        return (
            self.scope["http_version"] == "1.1"
            and headers.get(b"transfer-encoding", b"").lower() == b"chunked"
            and headers.get(b"content-type", b"").startswith(FRAMES_MEDIA_TYPE.encode())
            and not self.expect_100_continue  # the client would wait for a 100 that uvicorn's receive() sends
        )

    def _frame_body_ended(self, tail: bytes, after: bytes) -> None:
        body, self._frame_body = self._frame_body, None
        self.data_received(tail)  # httptools checks the last chunk and trailers, and ends the request
        body.close(accepted=not self.transport.is_closing())
        if after:
            self._received(memoryview(after))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        body = self._frame_body
        if body is not None:  # answered before its body ended
            if body.framing_lost:
                self.transport.close()
            else:
                body.discard()

    def on_body(self, body: bytes) -> None:
        # uvicorn appends each piece of a body to a bytearray, then copies that into the bytes its
        # ASGI message holds: two copies of every byte on the event loop's thread. A piece that
        # finds nothing waiting goes on as it is: b"" + body is body, and so is bytes(body)
        # (CPython hands back the same object). One that finds a piece waiting is appended to a
        # bytearray as before, so many small pieces never concatenate into new bytes each time.
        cycle = self.cycle
        if isinstance(cycle.body, bytes):
            cycle.body = bytearray(cycle.body)
        elif not cycle.body:
            cycle.body = b""
        super().on_body(body)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._frame_body is not None:
            self._frame_body.connection_lost()
            self._frame_body = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout_s, self._close_if_still_waiting)

    def _disarm(self) -> None:
        # A deadline left armed once the headers came would close the kept-alive connection later,
        # between two of its requests.
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close_if_still_waiting(self) -> None:
        self._deadline = None
        if not self._request_in_progress() and not self.transport.is_closing():
            logger.info("closed a connection that sent no complete request headers in %s s", self.header_timeout_s)
            self.transport.close()

    def _request_in_progress(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete
