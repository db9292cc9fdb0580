"""A POST whose chunked body goes from the caller's buffers to the socket with no copy of its own:
the client's side of a streamed weight push (`rollout.serve.weight_stream`).

httpx (on httpcore and h11) copies every piece of a streamed body once, joining it with its chunk
header. Here h11 still writes the request and reads the answer, so the HTTP/1.1 is h11's (Host
first, the chunked framing, an answer whatever its framing), but its `send_with_data_passthrough`
hands each piece back as it came, and the pieces go to the kernel in one `sendmsg` per few MiB:
the only copy on this side is the kernel's, into the socket. The client's CPU for a 1 GB push went
from 0.64 to 0.23 s (benchmarks/http_weight_push, process CPU, on a loaded 2-core machine), under
the server's event loop's 0.62 s: the server is the bound again.

The connection is this request's own, closed once the answer is read. The request asks for no
`Connection: close`: a server that answers before the body ends (a refused key, a frame over its
upload limit) would then close at once with the body's bytes unread, and a socket closed with
unread bytes resets the connection, which can drop the answer before this side reads it. Between
batches the socket is polled: an answer that came early (or a connection the server closed) stops
the sending, and the answer is read and returned as any other.

Only a plain "http://host:port[/path]" URL is taken (`SocketTarget.of`): TLS, credentials in the
URL, or a proxy from the environment (as httpx would use one) are left to httpx.
"""

from __future__ import annotations

import dataclasses
import select
import socket
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping

import h11

_BATCH_BYTES = 8 << 20  # bytes of pieces per sendmsg: a few hundred syscalls per GB, and a poll each
_BATCH_BUFFERS = 64  # buffers per sendmsg (under Linux's IOV_MAX, 1024): small tensors go out as they come
_READ_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class SocketTarget:
    """Where a plain-socket POST goes: `host`:`port`, paths under `base_path`."""

    host: str
    port: int
    base_path: str
    host_header: str

    @classmethod
    def of(cls, url: str) -> SocketTarget | None:
        """The target of `url`, or None where httpx has to carry the request (https, a user and
        password in the URL, a query, or a proxy that $HTTP_PROXY / $ALL_PROXY names for it)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.username or parts.query or parts.fragment:
            return None
        proxies = urllib.request.getproxies_environment()
        if ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass_environment(parts.netloc):
            return None
        return cls(parts.hostname, parts.port or 80, parts.path.rstrip("/"), parts.netloc)


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lowercase names
    content: bytes


class ConnectionFailed(Exception):
    """The request got no answer: the connection was refused, closed or reset, or the answer was
    not HTTP. `__cause__` is the socket's or h11's error."""


class AnswerTimedOut(ConnectionFailed):
    """A send or a read of the request waited past its timeout."""


def post_chunked(
    target: SocketTarget,
    path: str,
    headers: Mapping[str, str],
    pieces: Iterable[bytes | memoryview],
    *,
    timeout_s: float | None,
    connect_timeout_s: float,
) -> Answer:
    """POST `pieces` (bytes-like, each sent as a chunk of its own, read as they are sent) to
    `path`, with `headers`; returns the answer, an error one included. Raises ConnectionFailed
    (AnswerTimedOut when `timeout_s` passed while waiting to send or to read), or whatever the
    iteration of `pieces` raises: then the body is cut off without its last chunk, which the
    server takes as a body that failed."""
    http = h11.Connection(h11.CLIENT)
    fields = [("Host", target.host_header), *headers.items(), ("Transfer-Encoding", "chunked")]
    head = http.send(h11.Request(method="POST", target=target.base_path + path, headers=fields))
    with _connected(target, connect_timeout_s) as sock:
        sock.settimeout(timeout_s)
        sender = _Sender(sock)
        batch, size = [head], len(head)
        for piece in pieces:
            batch += http.send_with_data_passthrough(h11.Data(data=piece))
            size += len(piece)
            if size >= _BATCH_BYTES or len(batch) >= _BATCH_BUFFERS:
                if not sender.send(batch):
                    break
                batch, size = [], 0
        else:
            sender.send(batch + http.send_with_data_passthrough(h11.EndOfMessage()))
        return _answer(sock, http, sender.failure)


def _connected(target: SocketTarget, timeout_s: float) -> socket.socket:
    try:
        sock = socket.create_connection((target.host, target.port), timeout=timeout_s)
    except TimeoutError as error:
        raise AnswerTimedOut(f"connecting took over {timeout_s} s") from error
    except OSError as error:
        raise ConnectionFailed(f"cannot connect to {target.host_header} ({error})") from error
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the last chunk goes out at once
    return sock


class _Sender:
    """Writes batches of buffers to a socket until the server answers or the connection breaks;
    `failure` then holds the send's error, for when no answer can be read either."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.failure: OSError | None = None

    def send(self, buffers: list) -> bool:
        """Send all of `buffers`; False (nothing sent) once the server has said something (an
        early answer, or the end of the connection): the caller reads that instead."""
        if self.failure is not None or self._poll.poll(0):
            return False
        views = [memoryview(buffer).cast("B") for buffer in buffers]
        first = 0
        try:
            while first < len(views):
                sent = self._sock.sendmsg(views[first : first + _BATCH_BUFFERS])
                while first < len(views) and sent >= len(views[first]):
                    sent -= len(views[first])
                    first += 1
                if sent:
                    views[first] = views[first][sent:]
        except TimeoutError as error:
            raise AnswerTimedOut("sending the body stalled past the timeout (the server reads no more)") from error
        except OSError as error:  # closed or reset: the server may have answered before it closed
            self.failure = error
            return False
        return True


def _answer(sock: socket.socket, http: h11.Connection, send_failure: OSError | None) -> Answer:
    status, headers, content = 0, {}, bytearray()
    try:
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                http.receive_data(sock.recv(_READ_BYTES))  # b"" at the end of the connection
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
            elif isinstance(event, h11.Data):
                content += event.data
            elif isinstance(event, h11.EndOfMessage):
                return Answer(status, headers, bytes(content))
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionFailed("the server closed the connection without an answer") from send_failure
            # An InformationalResponse (a 100 Continue) is followed by the answer itself.
    except TimeoutError as error:
        raise AnswerTimedOut("no answer came within the timeout") from error
    except (OSError, h11.RemoteProtocolError) as error:
        what = "closed the connection" if send_failure is not None else "failed"
        raise ConnectionFailed(f"the server {what} before its answer ({error})") from send_failure or error
