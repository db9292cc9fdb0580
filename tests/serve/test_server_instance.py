"""Every answer of a server names its instance, so a client never mistakes a restarted server for
the one it was talking to (the restart itself, two server starts, is in test_server_lifetime.py)."""

from __future__ import annotations

import http.server
import json
import threading

import httpx
import pytest

from rollout import RemoteRolloutEngine
from rollout.errors import EngineDeadError
from rollout.http.wire import WireError
from rollout.serve.instance import INSTANCE_HEADER, WEIGHT_VERSION_HEADER
from rollout.serve.routes import ROUTES
from tests.serve.conftest import API_KEY

pytestmark = pytest.mark.timeout(120)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OTHER_INSTANCE = "0123456789abcdef-20260101T000000Z"


def test_every_answer_carries_the_servers_instance_id(server):
    answers = {}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for route in {(route.method, route.path) for route in ROUTES.values()}:
            method, path = route
            # A field no body has: a 422 (or, for a route that takes none, its plain answer), so no
            # route changes what the shared server holds (resume and wake_up do nothing here).
            body = {"json": {"not_a_field": 0}} if method == "POST" else {}
            answers[route] = http.request(method, path, **body)
        answers["404"] = http.get("/no_such_route")
        answers["401"] = http.get("/server_info", headers={"Authorization": ""})
        answers["415"] = http.post("/pause", content=b"{}", headers={"content-type": "text/plain"})
        stream_body = {"prompts": "x", "params": {"num_inference_steps": 1, "seed": 0}, "stream": True}
        with http.stream("POST", "/rollout/generate", json=stream_body) as stream:
            stream.read()
            answers["stream"] = stream
        info = http.get("/server_info").json()
    assert answers[("POST", "/pause")].status_code == 422  # the body was refused, nothing paused
    assert {answers[key].status_code for key in ("404", "401", "415", "stream")} == {404, 401, 415, 200}
    ids = {key: answer.headers.get(INSTANCE_HEADER) for key, answer in answers.items()}
    assert ids == dict.fromkeys(answers, server.instance_id)  # one id, for the server's whole life
    assert info["instance_id"] == server.instance_id
    assert answers[("GET", "/health")].json()["instance_id"] == server.instance_id
    assert all(answer.headers[WEIGHT_VERSION_HEADER] == str(info["weight_version"]) for answer in answers.values())


def test_a_request_for_another_instance_is_refused_without_running(server):
    headers = {**AUTH, INSTANCE_HEADER: OTHER_INSTANCE}
    refused = httpx.post(f"{server.url}/pause", json={"mode": "abort"}, headers=headers)
    assert refused.status_code == 412
    message = refused.json()["error"]["message"]
    assert OTHER_INSTANCE in message and server.instance_id in message and "it was not run" in message
    info = httpx.get(f"{server.url}/server_info", headers=AUTH).json()
    assert info["paused"] is False


def test_a_client_learns_the_instance_and_refuses_another(server, remote):
    assert remote.instance_id == server.instance_id
    assert remote.reconnect() == server.instance_id  # the same server: nothing changes
    version = remote.weight_version  # the shared server's: earlier tests may have pushed
    with pytest.raises(EngineDeadError) as raised:
        RemoteRolloutEngine(server.url, api_key=API_KEY, instance_id=OTHER_INSTANCE)
    message = str(raised.value)
    assert f"the rollout server at {server.url} restarted" in message
    assert f"{OTHER_INSTANCE} → {server.instance_id}" in message
    assert f"weight_version went from an unknown version to {version}" in message and "reconnect()" in message


class _HeaderlessHandler(http.server.BaseHTTPRequestHandler):
    """An HTTP server that is not a rollout server of this version: no instance header."""

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps({"engine_config": {}}).encode())

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def headerless_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HeaderlessHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()
    server.server_close()


def test_a_success_answer_without_the_instance_header_is_refused(headerless_url):
    with pytest.raises(WireError, match=f"carries no {INSTANCE_HEADER} header.*older than this client"):
        RemoteRolloutEngine(headerless_url)
