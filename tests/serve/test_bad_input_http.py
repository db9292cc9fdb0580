"""Auth, limits and bad bodies: each gets its 4xx with a message naming the field, and the server
stays up for the next good request. A dead worker turns every answer into a 503 with the reason."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
import torch

from rollout import RemoteRolloutEngine, SamplingParams
from rollout.http.frame_views import frame_pieces
from rollout.http.wire import FRAMES_MEDIA_TYPE, SAFETENSORS_MEDIA_TYPE, tensors_to_bytes
from rollout.serve.launch import ServerProcess
from rollout.serve.routes import body_json
from rollout.weights.state import base_state
from tests.executors.worker_functions import wait_gone
from tests.serve.conftest import API_KEY, EXTENSION_FLAGS

pytestmark = pytest.mark.timeout(240)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"prompts": ["ok"], "params": {"num_inference_steps": 1, "num_samples": 1, "seed": 0}}


def post(server, path, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=headers, timeout=60, **kwargs)


def error_of(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


def assert_still_serving(server):
    response = post(server, "/rollout/generate", json=GOOD)
    assert response.status_code == 200, response.text


def test_health_is_open_and_every_other_route_needs_the_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    missing = post(server, "/rollout/generate", headers={}, json=GOOD)
    assert missing.status_code == 401 and "Bearer" in error_of(missing)
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = post(server, "/rollout/generate", headers={"Authorization": "Bearer nope"}, json=GOOD)
    assert wrong.status_code == 403
    assert httpx.get(f"{server.url}/server_info").status_code == 401
    with pytest.raises(PermissionError):
        RemoteRolloutEngine(server.url, api_key="nope")
    assert_still_serving(server)


def test_a_client_given_no_key_reads_it_from_rollout_api_key(server, monkeypatch):
    monkeypatch.setenv("ROLLOUT_API_KEY", API_KEY)
    with RemoteRolloutEngine(server.url) as remote:  # its first call, /server_info, needs the key
        assert isinstance(remote.list_loras(), list)
    monkeypatch.setenv("ROLLOUT_API_KEY", "nope")
    with pytest.raises(PermissionError):
        RemoteRolloutEngine(server.url)
    monkeypatch.delenv("ROLLOUT_API_KEY")
    with pytest.raises(PermissionError):
        RemoteRolloutEngine(server.url)


def test_a_non_loopback_bind_without_a_key_is_refused(tiny_model):
    env = {key: value for key, value in os.environ.items() if key != "ROLLOUT_API_KEY"}
    command = [sys.executable, "-m", "rollout.serve", "--model", tiny_model, "--host", "0.0.0.0", "--no-auth"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--no-auth with --host 0.0.0.0" in done.stderr and "anyone could push weights" in done.stderr


@pytest.mark.parametrize(
    "body, status, names",
    [
        ({"prompts": ["x"], "params": {"num_inference_steps": "many"}}, 422, "params.num_inference_steps"),
        ({"prompts": ["x"], "params": {"guidance": 3}}, 422, "params.guidance: unknown field"),
        ({"prompts": ["x"], "temperature": 1.0}, 422, "temperature: unknown field"),
        ({"prompts": 7}, 422, "prompts"),
        ({"prompts": ["x"], "params": {"height": 33}}, 400, "height=33 is not divisible"),
        ({"prompts": ["x"], "params": {"lora": "nope"}}, 400, "lora 'nope' is not loaded"),
        ({"prompts": ["x"], "params": {"sampler": "euler"}}, 400, "sampler must be one of"),
        ({"prompts": ["x"] * 40, "params": {"num_samples": 2}}, 413, "--max-samples-per-request"),
        ({"prompts": ["x"] * 3, "params": {"branch_steps": [1, 2], "branch_factor": 5}}, 413, "asks for 75 samples"),
        ({"prompts": ["x"], "params": {"branch_steps": [1], "sde_window": [2, 4]}}, 400, "branch_steps [1] are ODE"),
        ({"prompts": ["x"], "params": {"record": ["x1"]}}, 400, "record must be a tuple of names"),
    ],
)
def test_bad_generate_bodies_get_their_4xx(server, body, status, names):
    response = post(server, "/rollout/generate", json=body)
    assert response.status_code == status, response.text
    assert names in error_of(response)
    assert_still_serving(server)


def test_a_body_over_the_limit_is_413(server):
    response = post(server, "/rollout/generate", json={"prompts": ["x" * 100_000]})
    assert response.status_code == 413 and "--max-body-mb" in error_of(response)
    json_type = {**AUTH, "content-type": "application/json"}
    body = iter([b"{" + b" " * 100_000 + b"}"])  # chunked: no length header
    chunked = post(server, "/rollout/generate", headers=json_type, content=body)
    assert chunked.status_code == 413
    assert_still_serving(server)


def test_malformed_and_oversized_safetensors_are_refused(server, remote):
    before = remote.weights_checksum()
    headers = {**AUTH, "content-type": SAFETENSORS_MEDIA_TYPE}
    not_json = (16).to_bytes(8, "little") + b"{not json at all"
    garbage = post(server, "/update_weights_from_tensor", headers=headers, content=not_json)
    assert garbage.status_code == 400 and "not a valid safetensors file" in error_of(garbage)
    truncated = post(server, "/update_weights_from_tensor", headers=headers, content=b"\xff" * 12)
    assert truncated.status_code == 400
    bad_options = tensors_to_bytes({}, {"request": json.dumps({"component": "transformer", "colour": "red"})})
    refused = post(server, "/update_weights_from_tensor", headers=headers, content=bad_options)
    assert refused.status_code == 422 and "colour: unknown field" in error_of(refused)
    huge = post(server, "/update_weights_from_tensor", headers=headers, content=b"\0" * (65 << 20))
    assert huge.status_code == 413 and "--max-upload-mb" in error_of(huge)
    assert remote.weights_checksum() == before
    assert_still_serving(server)


def _frame(kind: str, fields=None, tensors=None) -> bytes:
    return b"".join(frame_pieces(kind, fields, tensors))


def test_a_streamed_push_that_fails_midway_changes_nothing(server, remote, trainer_adapter):
    """Bodies that go wrong after two buckets were staged: cut off before the end frame, cut inside a
    frame, a malformed third frame, a wrong shape in the third bucket, a wrong count at the end,
    past the upload limit, a client that leaves. Each is a 4xx naming the problem (the engine
    answers once it has dropped what it staged); the weights and version stay."""
    state = base_state(trainer_adapter.transformer)
    names = sorted(state)[:4]
    new = {name: state[name] + 1 for name in names}
    options = body_json("update_weights", bucket_bytes=1)  # the server stages each tensor as it arrives
    buckets = [_frame("bucket", tensors={name: new[name]}) for name in names]
    start, end = _frame("update_weights", {"request": options}), _frame("end", {"tensors": len(names)})
    wrong_shape = _frame("bucket", tensors={names[2]: torch.zeros(3, 3)})
    garbage = (64).to_bytes(8, "little") + b"\x07" * 64
    too_long = (65 << 20).to_bytes(8, "little")  # a frame over --max-upload-mb 64, announced
    bodies = [
        (start + b"".join(buckets), 400, "cut off after 4 tensors, before its 'end' frame"),
        (start + b"".join(buckets) + end[:-5], 400, "ended inside a frame"),
        (start + b"".join(buckets[:2]) + garbage + buckets[3] + end, 400, "not a valid safetensors file"),
        (start + buckets[0] + buckets[1] + wrong_shape + buckets[3] + end, 400, f"{names[2]}: expected"),
        (start + b"".join(buckets) + _frame("end", {"tensors": 7}), 400, "counts 7 tensors"),
        (start + b"".join(buckets) + end + buckets[0], 400, "goes on after its 'end' frame"),
        (start + b"".join(buckets[:2]) + too_long, 413, "--max-upload-mb"),
        (_frame("update_weights", {"request": {**options, "colour": "red"}}) + end, 422, "colour: unknown field"),
    ]
    digest, version = remote.weights_checksum(), remote.weight_version
    headers = {**AUTH, "content-type": FRAMES_MEDIA_TYPE}
    client = httpx.Client(base_url=server.url, headers=headers, timeout=60)  # one: a client's setup costs 0.1 s
    for body, status, message in bodies:
        pieces = iter([body[i : i + 4096] for i in range(0, len(body), 4096)])  # chunked, as the client sends
        response = client.post("/update_weights_from_tensor", content=pieces)
        assert response.status_code == status and message in error_of(response), response.text
        assert remote.weight_version == version
    port = int(server.url.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as gone:  # leaves after two buckets
        head = f"POST /update_weights_from_tensor HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        sent = start + buckets[0] + buckets[1]
        head += f"Content-Type: {FRAMES_MEDIA_TYPE}\r\nTransfer-Encoding: chunked\r\n\r\n{len(sent):x}\r\n"
        gone.sendall(head.encode() + sent + b"\r\n")
    assert remote.weights_checksum() == digest and remote.weight_version == version  # after the rollback
    good = client.post("/update_weights_from_tensor", content=start + b"".join(buckets) + end)
    client.close()
    assert good.status_code == 200 and good.json() == {"weight_version": version + 1}
    remote.update_weights({name: state[name] for name in names}, version=version)
    assert remote.weights_checksum() == digest
    assert_still_serving(server)


def test_unknown_adapters_and_bad_values_elsewhere(server, remote):
    unload = post(server, "/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert unload.status_code == 400 and "no LoRA named 'nope'" in error_of(unload)
    missing_folder = post(server, "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/folder"})
    assert missing_folder.status_code == 400
    pause = post(server, "/pause", json={"mode": "sometimes"})
    assert pause.status_code == 422 and "mode" in error_of(pause)
    with pytest.raises(ValueError, match="lora 'nope' is not loaded"):
        remote.generate("x", SamplingParams(num_inference_steps=1, lora="nope"))
    assert_still_serving(server)


@pytest.mark.timeout(180)
@pytest.mark.slow  # a server of its own, killed: test_server_lifetime kills one in the default suite
def test_a_dead_worker_fails_health_and_every_call_with_503(tiny_model):
    flags = ("--executor", "mp", *EXTENSION_FLAGS, "--rpc-timeout-s", "20")
    with ServerProcess.start(tiny_model, *flags, api_key=API_KEY) as server:
        with RemoteRolloutEngine(server.url, api_key=API_KEY) as remote:
            (pid,) = remote.collective_rpc("pid")
            os.kill(pid, signal.SIGKILL)
            assert wait_gone([pid]) == []
            health = httpx.get(f"{server.url}/health", timeout=30)
            assert health.status_code == 503 and "worker" in error_of(health).lower()
            generate = post(server, "/rollout/generate", json=GOOD)
            assert generate.status_code == 503
            assert error_of(generate) == error_of(health)  # the reason, every time
            with pytest.raises(Exception, match="worker") as raised:
                remote.generate("x", SamplingParams(num_inference_steps=1))
            assert type(raised.value).__name__ == "EngineDeadError"
