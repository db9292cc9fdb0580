"""The server's HTTP protocol (`rollout.http.protocol`) on a bare uvicorn app in this process:
a body reaches the app byte for byte however its pieces arrive (the protocol hands a piece on
without uvicorn's copies when nothing waits, and appends when something does); a chunked frame
body on a frame route reaches it frame by frame, read by the protocol itself (`frame_body`), and
leaves the connection ready for the next request whether the route read it, answered before
reading it, or the body broke. Its time and size bounds on headers are tested against the real
server in test_careless_clients, streamed pushes in test_bad_input_http and test_hot_swap_http."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import socket
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout.http.frame_body import FRAME_BODY_EXTENSION
from rollout.http.protocol import server_protocol
from rollout.http.wire import FRAMES_MEDIA_TYPE, LENGTH, WireError
from rollout.serve.launch import free_port
from tests.threaded_server import served

pytestmark = pytest.mark.timeout(60)
FRAME_LIMIT = 4 << 20  # bytes of a body
IDLE_TIMEOUT_S = 1.0


async def digest(request):
    sha, size = hashlib.sha256(), 0
    async for chunk in request.stream():
        sha.update(chunk)
        size += len(chunk)
    return JSONResponse({"sha256": sha.hexdigest(), "bytes": size})


async def frame_digests(request):
    """The digest of each frame of the body, or what went wrong (kept in `app.state.errors`; the
    bodies read whole are counted in `app.state.bodies_read`);
    with `x-answer-first` it answers without reading the body, with `x-read-after-s` reads it late."""
    if request.headers.get("x-answer-first"):
        return JSONResponse({"read": False})
    await asyncio.sleep(float(request.headers.get("x-read-after-s", 0)))
    body = request.scope["extensions"][FRAME_BODY_EXTENSION]
    try:
        digests = [hashlib.sha256(f).hexdigest() async for f in body.frames(FRAME_LIMIT, "--limit", IDLE_TIMEOUT_S)]
    except HTTPException as error:
        request.app.state.errors.append(error.detail)
        return JSONResponse({"error": error.detail}, error.status_code)
    except WireError as error:
        request.app.state.errors.append(str(error))
        return JSONResponse({"error": str(error)}, 400)
    request.app.state.bodies_read += 1
    return JSONResponse({"frames": digests})


@pytest.fixture(scope="module")
def app():
    app = Starlette(
        routes=[Route("/digest", digest, methods=["POST"]), Route("/frames", frame_digests, methods=["POST"])]
    )
    app.state.errors, app.state.bodies_read = [], 0
    return app


@pytest.fixture(scope="module")
def port(app):
    port = free_port()
    config = uvicorn.Config(
        app, "127.0.0.1", port, http=server_protocol(5.0, frame_body_paths=["/frames"]), log_level="warning"
    )
    with served(uvicorn.Server(config), "the test server"):
        yield port


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


FRAMES_HEAD = (
    f"POST /frames HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {FRAMES_MEDIA_TYPE}\r\nTransfer-Encoding: chunked\r\n"
).encode()


def frames_body(rng: random.Random, count: int) -> tuple[bytes, list[str]]:
    payloads = [rng.randbytes(rng.choice([1, 40, 5000, 300_000])) for _ in range(count)]
    return b"".join(LENGTH.pack(len(p)) + p for p in payloads), [hashlib.sha256(p).hexdigest() for p in payloads]


def cut_in_chunks(data: bytes, rng: random.Random) -> bytes:
    """Chunks of odd sizes (frame lengths split between them) with extensions, then trailers."""
    out, at = [], 0
    while at < len(data):
        piece = data[at : at + rng.choice([1, 3, 8, 9, 1000, 70_000])]
        out.append(b"%x%s\r\n%s\r\n" % (len(piece), rng.choice([b"", b";ext", b';e="v"']), piece))
        at += len(piece)
    return b"".join(out) + b"0\r\nX-Trailer: yes\r\n\r\n"


def read_answer(answers) -> tuple[int, dict]:
    """One HTTP answer from a socket's file: its status and JSON body (uvicorn sends its length)."""
    status = int(answers.readline().split()[1])
    length = 0
    while (line := answers.readline()) != b"\r\n":
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return status, json.loads(answers.read(length))


def test_a_frame_body_reaches_its_route_frame_by_frame_and_the_connection_goes_on(port):
    rng = random.Random(1)
    body, digests = frames_body(rng, 12)
    second = b"POST /digest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n\r\nabc"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock, sock.makefile("rb") as answers:
        sock.sendall(FRAMES_HEAD + b"\r\n" + cut_in_chunks(body, rng) + second)  # the next request right after
        assert read_answer(answers) == (200, {"frames": digests})
        assert read_answer(answers) == (200, {"sha256": hashlib.sha256(b"abc").hexdigest(), "bytes": 3})


def test_a_frame_body_answered_before_it_is_read_is_read_to_its_end(port):
    rng = random.Random(2)
    body, _ = frames_body(rng, 8)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock, sock.makefile("rb") as answers:
        sock.sendall(FRAMES_HEAD + b"X-Answer-First: 1\r\n\r\n" + cut_in_chunks(body, rng))
        assert read_answer(answers) == (200, {"read": False})
        sock.sendall(
            FRAMES_HEAD + b"\r\n" + cut_in_chunks(LENGTH.pack(100) + b"x", rng)
        )  # the same connection, next request
        assert read_answer(answers) == (400, {"error": "the stream ended inside a frame (9 bytes of it arrived)"})


@pytest.mark.parametrize(
    ("body", "status", "fault"),
    [
        (b"zz\r\n", 400, "does not start with a hexadecimal size"),
        (b"3\r\nabcd\r\n", 400, "not CRLF"),
        (b"%x\r\n" % (2 * FRAME_LIMIT), 413, "limit of 4194304 bytes (--limit)"),
        (b"8\r\n" + LENGTH.pack(FRAME_LIMIT + 1) + b"\r\n", 413, "limit of 4194304 bytes (--limit)"),
    ],
)
def test_a_broken_or_oversized_frame_body_is_refused(port, body, status, fault):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock, sock.makefile("rb") as answers:
        sock.sendall(FRAMES_HEAD + b"\r\n" + body)
        answer_status, answer = read_answer(answers)
        assert answer_status == status and fault in answer["error"]
        if status == 400:  # where the body ends is lost: the connection is closed
            assert answers.read() == b""


def test_a_client_that_stalls_or_leaves_mid_body_fails_the_route(app, port):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock, sock.makefile("rb") as answers:
        sock.sendall(FRAMES_HEAD + b"\r\n" + b"10\r\n" + LENGTH.pack(100) + b"\0" * 8)
        start = time.monotonic()
        assert read_answer(answers) == (
            408,
            {"error": "the request body stalled for 1.0 s after 16 bytes (--body-timeout-s)"},
        )
        assert time.monotonic() - start < 5 * IDLE_TIMEOUT_S
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(FRAMES_HEAD + b"\r\n" + b"10\r\n" + LENGTH.pack(100) + b"\0" * 8)
        time.sleep(0.2)  # the route is waiting for the frame
    deadline = time.monotonic() + 10
    while "the client went away after 16 bytes of the body" not in app.state.errors:
        assert time.monotonic() < deadline, app.state.errors
        time.sleep(0.05)
    # All of a body sent with its head, and the connection closed before the route asks for it
    # (reading waits for the route, so the close is seen after the body): an answer, not a crash.
    outcomes = len(app.state.errors) + app.state.bodies_read
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        late = b"X-Read-After-S: 0.3\r\n\r\n"
        sock.sendall(FRAMES_HEAD + late + cut_in_chunks(LENGTH.pack(3) + b"abc", random.Random(3)))
    while len(app.state.errors) + app.state.bodies_read == outcomes:  # read, or refused: not a crash
        assert time.monotonic() < deadline + 10, app.state.errors
        time.sleep(0.05)
