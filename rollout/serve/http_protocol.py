"""uvicorn's HTTP/1.1 protocol, plus a bound on the time a connection may take to send a request's
headers.

uvicorn closes an idle kept-alive connection after its keep-alive timeout, but a connection that is
opened and sends nothing, or half a request, stays open until the client goes away: 50 such
connections held their sockets past 75 s, before any key was checked. Here a connection must finish
a request's headers within `header_timeout_s` of connecting, or of sending the first bytes of its
next request; otherwise it is closed. An idle kept-alive connection (nothing sent since its last
answer) is left to uvicorn's keep-alive timeout, so clients can reuse their connections.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def with_header_timeout(seconds: float) -> type[H11Protocol]:
    """The protocol class to give `uvicorn.Config(http=...)`."""
    return type("H11ProtocolWithHeaderTimeout", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_in_progress():  # its headers are all here: the bound is met
            self._disarm()
        else:  # the bytes of a request whose headers are not all here
            self._arm()

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
