"""The client's streamed weight push over a socket of its own (`rollout.serve.socket_post`) against
the real server: bitwise what the httpx push gives, however buckets cut the tensors; the server's
error answer, mid-body or before it, is the httpx push's exception; a connection cut mid-body (a
relay that closes both sides) is the same EngineDeadError on both paths, and the weights stay."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import torch

from rollout import RemoteRolloutEngine
from rollout.errors import EngineDeadError
from rollout.http.wire import FRAMES_MEDIA_TYPE
from rollout.pipelines.loading import load_adapter
from rollout.serve.routes import ROUTES, body_json
from rollout.serve.socket_post import SocketTarget, post_chunked
from rollout.serve.weight_stream import weight_frames
from rollout.weights.state import base_state, checksum
from tests.serve.conftest import API_KEY

pytestmark = pytest.mark.timeout(240)
PATHS = ("socket", "httpx")


@pytest.fixture(scope="module")
def transformer_state(tiny_model):
    return base_state(load_adapter(tiny_model).transformer)


@pytest.fixture
def clients(server, remote):
    """One client per push path: `remote` itself pushes over its socket (the default)."""
    with RemoteRolloutEngine(server.url, api_key=API_KEY, weight_push="httpx") as over_httpx:
        yield {"socket": remote, "httpx": over_httpx}


def random_state(transformer_state, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator, dtype=t.dtype) for name, t in transformer_state.items()}


@pytest.mark.parametrize("bucket_bytes", [1, 3001, 1 << 16, 1 << 29])  # a tensor each, odd cuts, a few, one
def test_the_socket_push_applies_what_the_httpx_push_does(clients, transformer_state, bucket_bytes):
    start = clients["socket"].weight_version
    for offset, (name, client) in enumerate(clients.items()):
        new_state = random_state(transformer_state, seed=bucket_bytes + offset)
        assert client.update_weights(iter(new_state.items()), bucket_bytes=bucket_bytes) == start + 1 + offset, name
        assert client.weights_checksum() == checksum(new_state), name
    # The same tensors each way give the same weights, bit for bit.
    for name, client in clients.items():
        client.update_weights(transformer_state, bucket_bytes=bucket_bytes)
        assert client.weights_checksum() == checksum(transformer_state), name
    clients["socket"].update_weights(transformer_state, version=start)


def test_an_error_answer_mid_body_is_the_httpx_push_s_exception(clients, transformer_state):
    """A bucket over the server's --max-upload-mb (64) is answered 413 as its length arrives, with
    the body still going out; the socket path stops sending and raises the server's message."""
    before, version = clients["socket"].weights_checksum(), clients["socket"].weight_version
    errors, pulled = {}, {name: [] for name in clients}

    def pairs(pulled: list):
        yield "too.big", torch.zeros(20 << 20)  # 80 MiB in one frame
        for index in range(4):  # more buckets, pulled only once that one is sent whole
            pulled.append(index)
            yield f"more.{index}", torch.zeros(1 << 20)

    for name, client in clients.items():
        with pytest.raises(ValueError) as raised:
            client.update_weights(pairs(pulled[name]), bucket_bytes=1)
        errors[name] = raised.value
    assert pulled == {"socket": [], "httpx": [0, 1, 2, 3]}  # the socket path stopped when the answer came
    assert type(errors["socket"]) is type(errors["httpx"])
    assert str(errors["socket"]) == str(errors["httpx"])
    assert "--max-upload-mb" in str(errors["socket"])
    assert clients["socket"].weights_checksum() == before
    assert clients["socket"].weight_version == version
    assert clients["socket"].update_weights(transformer_state) == version + 1  # the client pushes on


def test_a_refused_key_is_answered_before_the_body_is_read(server, transformer_state):
    """The key is checked before the route reads the body: the socket path gets the answer httpx
    does (a big body the server drains, or that this side stops sending once the answer came)."""
    options = body_json("update_weights", bucket_bytes=1 << 12)
    headers = {"authorization": "Bearer not-the-key", "content-type": FRAMES_MEDIA_TYPE}
    state = {**transformer_state, "padding": torch.zeros(8 << 20)}  # 32 MiB more
    route = ROUTES["update_weights"].path
    answer = post_chunked(
        SocketTarget.of(server.url),
        route,
        headers,
        weight_frames(state, options, 1 << 12),
        timeout_s=30.0,
        connect_timeout_s=10.0,
    )
    expected = httpx.post(server.url + route, content=weight_frames(state, options, 1 << 12), headers=headers)
    assert (answer.status, json.loads(answer.content)) == (expected.status_code, expected.json())
    assert answer.status == 403 and "wrong API key" in expected.text


def test_a_client_side_failure_mid_body_leaves_the_weights(clients, transformer_state):
    """The body's iterator fails after some buckets have gone out: the body ends without its
    last chunk, the server drops what it staged, and the caller gets the iterator's own error."""
    before, version = clients["socket"].weights_checksum(), clients["socket"].weight_version

    def failing_pairs():
        yield from random_state(transformer_state, seed=3).items()  # every tensor goes out, changed
        raise RuntimeError("the trainer's iterator failed")

    for client in clients.values():
        with pytest.raises(RuntimeError, match="the trainer's iterator failed"):
            client.update_weights(failing_pairs(), bucket_bytes=1)
        assert client.weights_checksum() == before
        assert client.weight_version == version


@contextlib.contextmanager
def cutting_relay(upstream: str, cut_after: int) -> Iterator[str]:
    """A TCP relay to `upstream` that closes both sides of a connection once it has carried
    `cut_after` bytes towards the server (a server that goes away mid-body, to the client)."""
    target = SocketTarget.of(upstream)
    listener = socket.create_server(("127.0.0.1", 0))
    threads: list[threading.Thread] = []

    def relay(client: socket.socket) -> None:
        server = socket.create_connection((target.host, target.port))
        back = threading.Thread(target=pump, args=(server, client, None), daemon=True)
        back.start()
        pump(client, server, cut_after)
        back.join(30)

    def pump(source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        carried = 0
        try:
            while data := source.recv(1 << 16):
                if limit is not None and carried + len(data) > limit:
                    break
                sink.sendall(data)
                carried += len(data)
        except OSError:
            pass
        for end in (source, sink):  # both sides go, as a server that closes
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                thread = threading.Thread(target=relay, args=(client,), daemon=True)
                thread.start()
                threads.append(thread)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() that waits
        listener.close()
        acceptor.join(10)
        for thread in threads:
            thread.join(30)


@pytest.mark.parametrize("path", PATHS)
def test_a_connection_closed_mid_body_is_engine_dead_and_the_weights_stay(server, remote, transformer_state, path):
    before, version = remote.weights_checksum(), remote.weight_version
    nbytes = sum(t.nbytes for t in transformer_state.values())
    new_state = random_state(transformer_state, seed=7)
    with (
        cutting_relay(server.url, cut_after=nbytes // 2) as url,
        RemoteRolloutEngine(url, api_key=API_KEY, weight_push=path, instance_id=remote.instance_id) as cut,
    ):
        with pytest.raises(EngineDeadError, match="lost the rollout server"):
            cut.update_weights(new_state, bucket_bytes=1 << 12)
    assert remote.weights_checksum() == before
    assert remote.weight_version == version


def test_the_socket_path_is_only_for_plain_http(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert SocketTarget.of("http://127.0.0.1:8000/base/") == SocketTarget("127.0.0.1", 8000, "/base", "127.0.0.1:8000")
    assert SocketTarget.of("http://[::1]:9/").host == "::1"
    for url in ("https://127.0.0.1:8000", "http://user:secret@127.0.0.1:8000", "http://127.0.0.1:8000/?q=1"):
        assert SocketTarget.of(url) is None, url
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert SocketTarget.of("http://10.0.0.1:8000") is None  # httpx would go through the proxy
    monkeypatch.setenv("NO_PROXY", "10.0.0.1")
    assert SocketTarget.of("http://10.0.0.1:8000") is not None
    with pytest.raises(ValueError, match="weight_push must be one of"):
        RemoteRolloutEngine("http://127.0.0.1:1", weight_push="raw")
