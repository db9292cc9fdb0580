"""The server's HTTP protocol (`rollout.serve.http_protocol`) on a bare uvicorn app in this process:
a body reaches the app byte for byte however its pieces arrive (the protocol hands a piece on
without uvicorn's copies when nothing waits, and appends when something does). Its time and size
bounds on headers are tested against the real server in test_careless_clients."""

from __future__ import annotations

import hashlib
import random
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout.serve.http_protocol import with_header_timeout
from rollout.serve.launch import free_port

pytestmark = pytest.mark.timeout(60)


async def digest(request):
    sha, size = hashlib.sha256(), 0
    async for chunk in request.stream():
        sha.update(chunk)
        size += len(chunk)
    return JSONResponse({"sha256": sha.hexdigest(), "bytes": size})


@pytest.fixture(scope="module")
def port():
    port = free_port()
    config = uvicorn.Config(
        Starlette(routes=[Route("/digest", digest, methods=["POST"])]),
        "127.0.0.1",
        port,
        http=with_header_timeout(5.0),
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(10)


def chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


def test_a_body_arrives_whole_in_pieces_of_every_size(port):
    rng = random.Random(0)
    # Runs of tiny pieces (many per read: appended to one waiting), then big ones (handed on alone).
    pieces = [rng.randbytes(rng.randint(1, 300)) for _ in range(3000)]
    pieces += [rng.randbytes(rng.randint(100_000, 1_500_000)) for _ in range(6)]
    pieces += [rng.randbytes(rng.randint(1, 50)) for _ in range(500)]
    body = b"".join(pieces)
    head = b"POST /digest HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + chunked(pieces))
        answer = b""
        while b"}" not in answer and (data := sock.recv(65536)):
            answer += data
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    expected = f'{{"sha256":"{hashlib.sha256(body).hexdigest()}","bytes":{len(body)}}}'.encode()
    assert answer.endswith(expected), answer[-200:]
