"""uvicorn's HTTP/1.1 protocol on httptools' C parser, plus bounds on the time and the bytes a
connection may take to send a request's headers.

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
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)


def with_header_timeout(seconds: float) -> type[HttpToolsProtocol]:
    """The protocol class to give `uvicorn.Config(http=...)`."""
    return type("HttpToolsProtocolWithHeaderTimeout", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0
    max_header_bytes = 64 << 10  # an API key and a few headers need ~1 KiB
    _deadline: asyncio.TimerHandle | None = None
    _in_headers = False  # the parser is inside a request's URL or headers
    _header_bytes = 0  # received of them

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        # Bytes that come while no request is in progress are the next request's; while one is, a
        # chunk may hold the end of its body, so only the chunks after the next one's begins count.
        counted = self._in_headers or not self._request_in_progress()
        super().data_received(data)
        if counted and self._in_headers:  # chunks of a request's URL and headers that did not end them
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes and not self.transport.is_closing():
                logger.info("refused a request whose headers ran past %s bytes", self.max_header_bytes)
                self.send_400_response(
                    f"The request's URL and headers are over this server's limit of {self.max_header_bytes} bytes."
                )
                return
        if self._request_in_progress():  # its headers are all here: the time bound is met
            self._disarm()
        else:  # the bytes of a request whose headers are not all here
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers, self._header_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._in_headers = False
        super().on_headers_complete()

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
