"""A shared server against careless and hostile clients: strict types and finite numbers, the
documented error body everywhere, no door for a web page (foreign Host, non-JSON bodies), the schema
behind the key, and a key by default. Each probe gets its 4xx within a second and the server
serves the next good request."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from rollout import SamplingParams
from rollout.http.wire import FRAMES_MEDIA_TYPE, frame
from rollout.serve.launch import ServerProcess, free_port
from rollout.serve.routes import body_json
from tests.serve.conftest import API_KEY

pytestmark = pytest.mark.timeout(240)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"prompts": ["ok"], "params": {"num_inference_steps": 1, "num_samples": 1, "seed": 0}}


def post(server, path, *, json_body=None, raw=None, headers=None) -> httpx.Response:
    headers = {**AUTH, **(headers or {})}
    if raw is not None:
        headers.setdefault("content-type", "application/json")
        return httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=60)
    return httpx.post(f"{server.url}{path}", json=json_body, headers=headers, timeout=60)


def timed_post(server, path, **kwargs) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = post(server, path, **kwargs)
    return response, time.monotonic() - start


def quicker_than(seconds: float, baseline: float) -> bool:
    """Within twice a baseline measured in the same test (a loaded machine slows both alike), plus
    a scheduler tick for a baseline of milliseconds."""
    return seconds < 2 * baseline + 0.05


def refused_in_a_second(server, path, status, names, **kwargs) -> None:
    """Refused with `status` naming `names`, no slower than a one-step generate (which follows, and
    works)."""
    response, refused_s = timed_post(server, path, **kwargs)
    assert response.status_code == status, response.text
    assert names in response.json()["error"]["message"], response.text
    good, good_s = timed_post(server, "/rollout/generate", json_body=GOOD)
    assert good.status_code == 200
    assert quicker_than(refused_s, good_s), (refused_s, good_s)


def params(**fields) -> bytes:
    """A generate body with `fields` written into its params as raw JSON text (NaN is not JSON)."""
    return ('{"prompts": ["x"], "params": {' + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}}").encode()


@pytest.mark.parametrize(
    "raw, status, names",
    [
        (params(num_samples='"2"'), 422, "params.num_samples: Input should be a valid integer"),
        (params(num_inference_steps="true"), 422, "params.num_inference_steps: Input should be a valid integer"),
        (params(num_inference_steps="1e30"), 422, "params.num_inference_steps: Input should be a valid integer"),
        (params(same_noise_in_group='"yes"'), 422, "params.same_noise_in_group: Input should be a valid boolean"),
        (params(noise_level="NaN"), 422, "params.noise_level: Input should be a finite number"),
        (params(noise_level="Infinity"), 422, "params.noise_level: Input should be a finite number"),
        (params(guidance_scale="NaN"), 422, "params.guidance_scale: Input should be a finite number"),
        (params(guidance_scale="1e308"), 400, "guidance_scale must be a number in [0, 1000]"),
        (params(noise_level="1e30"), 400, "noise_level must be <= 10, got 1e+30"),
        (params(sampler='"cps"', noise_level="3"), 400, "noise_level must be <= 1 for CPS"),
        (params(height="-32"), 400, "height must be a positive integer"),
        # Bounds: refused before anything is built (an 83-byte body once froze every route for 12 s).
        (params(num_inference_steps="100000000", branch_steps="[0]"), 400, "must be at most 100000"),
        (params(branch_steps="[0]", branch_factor="1" + "0" * 30), 400, "more than 2**24 leaves"),
        (
            params(num_inference_steps="5000"),
            400,
            "limit of 1000 (RequestLimits.max_inference_steps; a server's --max",
        ),
    ],
)
def test_numbers_are_strict_and_finite(server, raw, status, names):
    refused_in_a_second(server, "/rollout/generate", status, names, raw=raw)


def test_negative_sizes_and_timeouts_are_refused(server):
    rpc = {"method": "get_rank", "timeout": -1}
    refused_in_a_second(server, "/collective_rpc", 422, "timeout: Input should be greater than 0", json_body=rpc)
    distributed = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "bucket_bytes": -1}
    refused_in_a_second(
        server,
        "/update_weights_from_distributed",
        422,
        "bucket_bytes: Input should be greater than 0",
        json_body=distributed,
    )


def test_unknown_routes_and_methods_use_the_documented_error_body(server):
    missing = httpx.get(f"{server.url}/no/such/route", headers=AUTH)
    assert missing.status_code == 404 and missing.json() == {"error": {"type": "HTTPError", "message": "Not Found"}}
    wrong_method = httpx.get(f"{server.url}/rollout/generate", headers=AUTH)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"] == "Method Not Allowed"


def test_a_web_page_finds_no_door(server):
    """DNS rebinding sends a foreign Host; a page's cross-origin POST without a preflight can only
    be text/plain (or a form): both are refused before the key is even looked at."""
    rebound = httpx.post(
        f"{server.url}/rollout/generate", json=GOOD, headers={**AUTH, "host": "attacker.example:8000"}, timeout=60
    )
    assert rebound.status_code == 400 and "does not name this server" in rebound.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health", headers={"host": "attacker.example"}).status_code == 400
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**AUTH} if content_type is None else {**AUTH, "content-type": content_type}
        response = httpx.post(f"{server.url}/resume", content=b"{}", headers=headers, timeout=60)
        assert response.status_code == 415, response.text
        assert "must be sent as application/json" in response.json()["error"]["message"]
    assert httpx.post(f"{server.url}/resume", json={}, headers={**AUTH, "host": "localhost"}).status_code == 200


def test_the_schema_and_its_pages_follow_the_key(server):
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(f"{server.url}{path}").status_code == 401
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200
    assert httpx.get(f"{server.url}/redoc", headers=AUTH).status_code == 404
    schema = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    assert "/rollout/generate" in schema["paths"] and "/openapi.json" not in schema["paths"]


def test_keys_on_the_command_line(monkeypatch, capsys):
    from rollout.serve.__main__ import parse_args

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as exited:
            parse_args(list(argv))
        assert exited.value.code != 0
        return capsys.readouterr().err

    monkeypatch.setenv("ROLLOUT_API_KEY", "s3cret-from-the-environment")
    with pytest.raises(SystemExit) as exited:
        parse_args(["--help"])
    helped = capsys.readouterr().out
    assert exited.value.code == 0 and "s3cret" not in helped and "--no-auth" in helped
    assert parse_args(["--model", "m"]).api_key == "s3cret-from-the-environment"
    monkeypatch.setenv("ROLLOUT_API_KEY", "  ")
    assert "the API key (--api-key or $ROLLOUT_API_KEY) is empty" in refused("--model", "m")
    monkeypatch.delenv("ROLLOUT_API_KEY")
    assert "not allowed with argument" in refused("--model", "m", "--api-key", "k", "--no-auth")
    assert "--no-auth with --host 0.0.0.0" in refused("--model", "m", "--host", "0.0.0.0", "--no-auth")
    assert parse_args(["--model", "m", "--no-auth"]).api_key is None


@pytest.mark.slow  # a server of its own: 10-15 s
@pytest.mark.timeout(180)
def test_without_a_key_the_server_makes_one_only_its_user_can_read(tiny_model, tmp_path):
    key_file = tmp_path / "keys" / "serve.key"
    port = free_port()
    command = [sys.executable, "-m", "rollout.serve", "--model", tiny_model, "--port", str(port)]
    environment = {k: v for k, v in os.environ.items() if k != "ROLLOUT_API_KEY"}
    process = subprocess.Popen(
        [*command, "--api-key-file", str(key_file), "--log-level", "warning"], env=environment, stderr=subprocess.PIPE
    )
    server = ServerProcess(process, f"http://127.0.0.1:{port}")
    try:
        server._wait_until_healthy(120)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text()
        assert len(key) >= 32
        assert httpx.post(f"{server.url}/resume", json={}).status_code == 401
        assert (
            httpx.post(f"{server.url}/resume", json={}, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        )
    finally:
        assert server.stop() == -signal.SIGTERM
    assert not key_file.exists()  # removed at exit
    assert f"generated one into {key_file}" in process.stderr.read().decode()


def test_a_request_that_fails_in_the_worker_fails_alone(server, remote):
    """The worker raises for one request (as for a shape its model cannot take): that request gets
    a 400 with the engine's message and no traceback while a request that started before it still
    runs; that one finishes with the same bytes as alone; /health answers throughout."""
    params = SamplingParams(num_inference_steps=4, num_samples=1, seed=21)
    doomed = {"prompts": ["doomed"], "params": {"num_inference_steps": 4, "num_samples": 1, "seed": 0}}
    remote.collective_rpc("set_step_delay", args=(0.1,))  # the two share steps
    start = time.monotonic()
    (alone,) = remote.generate("fine", params)
    alone_s = time.monotonic() - start  # four steps; the doomed one fails in its first
    remote.collective_rpc("fail_prompt", args=("doomed",))
    try:
        with ThreadPoolExecutor(1) as pool:
            fine = pool.submit(remote.generate, "fine", params)
            time.sleep(0.15)
            start = time.monotonic()
            refused = post(server, "/rollout/generate", json_body=doomed)
            elapsed = time.monotonic() - start
            # Promptly: while the request that started first, and needs four steps, still runs (a
            # baseline that slows with the machine, as the two share its steps).
            fine_still_running = not fine.done()
            health_start = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            assert time.monotonic() - health_start < 2.0
            (together,) = fine.result(timeout=60)
    finally:
        remote.collective_rpc("set_step_delay", args=(0.0,))
        remote.collective_rpc("fail_prompt", args=(None,))
    assert refused.status_code == 400 and fine_still_running, (refused.status_code, elapsed, alone_s)
    message = refused.json()["error"]["message"]
    assert "failed in a worker, alone" in message and "injected failure" in message
    assert "Traceback" not in refused.text and 'File "' not in refused.text
    assert torch.equal(together.image, alone.image)
    assert torch.equal(together.trajectory.latents.stack(), alone.trajectory.latents.stack())
    assert remote.server_info()["unfinished_requests"] == 0
    assert remote.collective_rpc("request_ids") == [[]]


@pytest.mark.parametrize(
    "method, args, route",
    [
        ("sleep", [1], "/release_memory_occupation"),
        ("wake_up", [], "/resume_memory_occupation"),
        ("unload_lora", ["policy"], "/v1/unload_lora_adapter"),
        ("stage_weights", ["transformer", {}], "/update_weights_from_tensor"),
        ("init_weight_update_group", ["0.0.0.0", 29500, 0, 1, "gloo", 1.0], "/init_weight_update_group"),
        ("execute", [{}], "/rollout/generate"),
    ],
)
def test_collective_rpc_reaches_only_what_keeps_the_engine_s_books(server, remote, method, args, route):
    """Over HTTP a client may call the read-only worker functions and the extension's; the ones that
    change what the engine keeps (asleep while /server_info says awake, weights without a version, a
    TCPStore on every interface) are refused with the route that does it properly."""
    body = {"method": method, "args": args}
    refused_in_a_second(server, "/collective_rpc", 403, f"use {route}", json_body=body)
    refused = post(server, "/collective_rpc", json_body=body).json()["error"]["message"]
    assert f"--rpc-allow {method}" in refused
    assert remote.server_info()["sleep_level"] == 0 and remote.collective_rpc("hot_swap_state")[0]["sleep_level"] == 0
    assert remote.collective_rpc("weights_checksum", args=("transformer",)) == [remote.weights_checksum()]


def test_rpc_allow_lets_the_operator_open_a_method(tiny_model):
    from starlette.testclient import TestClient

    from rollout import EngineConfig, RolloutEngine
    from rollout.engine.async_engine import AsyncRolloutEngine
    from rollout.serve.app import ServerSettings, build_app

    engine = AsyncRolloutEngine(RolloutEngine(EngineConfig(model=tiny_model)))
    try:
        settings = ServerSettings(allowed_hosts=None, rpc_allow=frozenset({"check_health", "sleep"}))
        with TestClient(build_app(engine, settings)) as client:
            assert client.post("/collective_rpc", json={"method": "sleep", "args": [1]}).status_code == 200
            assert client.post("/collective_rpc", json={"method": "wake_up"}).status_code == 403
    finally:
        engine.shutdown()


def test_every_worker_function_is_either_read_only_or_has_an_engine_route():
    """A new worker function must be placed: callable by name over HTTP, or refused with its route."""
    from rollout.serve.app import _ENGINE_ROUTES
    from rollout.worker.marks import worker_functions
    from rollout.worker.worker import READ_ONLY_METHODS, Worker

    assert worker_functions(Worker) == READ_ONLY_METHODS | set(_ENGINE_ROUTES)
    assert not READ_ONLY_METHODS & set(_ENGINE_ROUTES)


def test_server_info_never_shows_the_key(server):
    info = httpx.get(f"{server.url}/server_info", headers=AUTH)
    assert API_KEY not in json.dumps(info.json())


@pytest.fixture(scope="module")
def adapter(tiny_model):
    """A random rank-2 adapter (PEFT keys) of the tiny transformer and its config."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from rollout.pipelines.loading import load_adapter

    transformer = load_adapter(tiny_model).transformer
    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_v"], init_lora_weights=False)
    transformer.add_adapter(config, adapter_name="made")
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(transformer, adapter_name="made").items()}
    return tensors, {"r": 2, "lora_alpha": 4, "target_modules": ["to_q", "to_v"]}


def upload(server, name: str, tensors: dict, config: dict, version: int | None) -> httpx.Response:
    """Upload an adapter under `name`; `version`: the weight version it sets (tests share the
    server, and others compare its versions with an engine of their own)."""
    from rollout.http.wire import SAFETENSORS_MEDIA_TYPE, tensors_to_bytes

    request = {"lora_name": name, "lora_config": config, "version": version}
    body = tensors_to_bytes(tensors, {"request": json.dumps(request)})
    return httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        content=body,
        headers={**AUTH, "content-type": SAFETENSORS_MEDIA_TYPE},
        timeout=60,
    )


def test_lora_uploads_that_cannot_hurt(server, remote, adapter):
    """A regular expression for target_modules (a backtracking one froze a server), configs that
    build more than LoRA layers, a bad name, a rank its tensors do not have, a hot swap with
    a key that is no LoRA tensor: each is refused, the next good upload works, and the adapter
    that served before serves on, bitwise."""
    tensors, config = adapter
    params = SamplingParams(num_inference_steps=2, seed=4, lora="policy")
    version = remote.weight_version
    start = time.monotonic()
    assert upload(server, "policy", tensors, config, None).status_code == 200  # version + 1
    good_s = time.monotonic() - start
    (before,) = remote.generate("kept", params)
    bad_uploads = [
        ("policy", {**config, "target_modules": "(?:[^.]|[^.]|[^.])*Q"}, 400, "target_modules must be a list"),
        ("policy", {**config, "r": -1}, 400, "r must be an integer in [1, 1024]"),
        ("policy", {**config, "layer_replication": [[0, 1]]}, 400, "layer_replication is not taken"),
        ("policy", {**config, "rank_pattern": {".*": 8}}, 400, "rank_pattern is not taken"),
        ("", config, 400, "a LoRA name is 1-64 letters"),
        ("policy", {**config, "lora_dropout": 2.0}, 400, "lora_dropout must be a number in [0, 1)"),
        # Rank 3 with rank-2 tensors: refused naming a tensor, as a hot swap of the same layout is (it
        # failed inside PEFT with a raw size mismatch, a 409, before issue 50).
        ("policy", {**config, "r": 3}, 400, "LoRA 'policy' refused: transformer_blocks."),
        ("fresh", {**config, "r": 3}, 400, "LoRA 'fresh' refused: transformer_blocks."),
    ]
    for name, bad, status, message in bad_uploads:
        start = time.monotonic()
        response = upload(server, name, tensors, bad, version)
        assert quicker_than(time.monotonic() - start, good_s), (name, bad, good_s)
        assert response.status_code == status and message in response.json()["error"]["message"], response.text
    key = sorted(tensors)[0]
    bogus = {**tensors, key.replace(".lora_A.", ".lora_C."): tensors[key].clone()}
    refused = upload(server, "policy", bogus, config, version)
    assert refused.status_code == 400 and "are not LoRA tensor names" in refused.json()["error"]["message"]
    assert remote.list_loras() == ["policy"] and remote.weight_version == version + 1
    (after,) = remote.generate("kept", params)
    assert torch.equal(after.image, before.image)
    # The next load works; under the version the other tests compare with (held before: allowed).
    assert upload(server, "fresh", tensors, config, version).status_code == 200
    remote.unload_lora("fresh")
    remote.unload_lora("policy")


def test_paths_that_are_not_regular_files_are_refused_not_waited_on(server, remote, adapter, tmp_path):
    from safetensors.torch import save_file

    tensors, config = adapter
    fifo_folder = tmp_path / "fifo_weights"
    fifo_folder.mkdir()
    os.mkfifo(fifo_folder / "diffusion_pytorch_model.safetensors")
    device_link = tmp_path / "random.safetensors"
    device_link.symlink_to("/dev/urandom")
    folder_named_like_weights = tmp_path / "dir_weights"
    (folder_named_like_weights / "x.safetensors").mkdir(parents=True)
    fifo_lora = tmp_path / "fifo_lora"
    fifo_lora.mkdir()
    (fifo_lora / "adapter_config.json").write_text(json.dumps(config))
    os.mkfifo(fifo_lora / "adapter_model.safetensors")
    sparse_lora = tmp_path / "sparse_lora"
    sparse_lora.mkdir()
    save_file(tensors, sparse_lora / "adapter_model.safetensors")
    with open(sparse_lora / "adapter_config.json", "wb") as sparse:
        sparse.truncate(1 << 30)  # 1 GB that costs no disk
    digest = remote.weights_checksum()
    probes = [
        ("/update_weights_from_disk", {"model_path": str(fifo_folder)}, "is a FIFO (named pipe), not a regular file"),
        ("/update_weights_from_disk", {"model_path": str(device_link)}, "is a character device, not a regular file"),
        ("/update_weights_from_disk", {"model_path": str(folder_named_like_weights)}, "is a directory"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(fifo_lora)}, "is a FIFO (named pipe)"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(sparse_lora)}, "more than the 1048576"),
    ]
    for path, body, message in probes:
        refused_in_a_second(server, path, 400, message, json_body=body)
    assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
    assert remote.weights_checksum() == digest and remote.list_loras() == []


# Slow: a server of its own and timeouts it waits out (13 s of the default suite's budget).
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_connections_cannot_be_held_open_for_free(tiny_model):
    """Half-sent headers and stalled bodies are cut off; an idle kept-alive connection is not;
    past --max-connections a new request gets a 503."""
    import http.client
    import socket

    flags = ("--header-timeout-s", "1", "--body-timeout-s", "1", "--max-connections", "12")
    with ServerProcess.start(tiny_model, *flags, api_key=API_KEY) as server:
        port = int(server.url.rpartition(":")[2])

        def connect() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            return sock

        silent = [connect() for _ in range(5)]
        half = [connect() for _ in range(5)]
        for sock in half:
            sock.sendall(b"POST /rollout/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: never done
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # keeps its connection alive
        kept.request("GET", "/health")
        assert json.loads(kept.getresponse().read())["status"] == "ok"
        kept_socket = kept.sock
        start = time.monotonic()
        for sock in silent + half:
            assert sock.recv(1) == b""  # closed by the server
            sock.close()
        closed_s = time.monotonic() - start
        time.sleep(max(0.0, 1.5 - closed_s))  # past the header timeout since it connected and since it asked
        kept.request("GET", "/health")  # on the same connection (a closed one raises here)
        assert json.loads(kept.getresponse().read())["status"] == "ok" and kept.sock is kept_socket
        kept.close()
        assert closed_s < 5
        endless = connect()  # headers that never end: refused at the limit, not kept in memory
        # Just past the limit, so that the server has read it all when it closes (unread bytes would reset).
        endless.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"x" * (64 << 10))
        answer = b""
        while chunk := endless.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 400") and b"limit of 65536 bytes" in answer, answer
        endless.close()
        stalled = connect()
        stalled.sendall(
            b"POST /pause HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n".encode()
            + b"{"
        )
        answer = b""
        while b"--body-timeout-s" not in answer and (chunk := stalled.recv(4096)):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in answer
        stalled.close()
        # A streamed push that stalls mid-bucket: 408 once the engine has dropped what it staged.
        options = frame("update_weights", {"request": body_json("update_weights", bucket_bytes=1)})
        half_bucket = frame("bucket", tensors={"x": torch.zeros(32)})[:40]  # never completed
        stalled = connect()
        stalled.sendall(
            b"POST /update_weights_from_tensor HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Content-Type: {FRAMES_MEDIA_TYPE}\r\nAuthorization: Bearer {API_KEY}\r\n".encode()
            + b"Content-Length: 100000\r\n\r\n"
            + options
            + half_bucket
        )
        answer = b""
        while b"--body-timeout-s" not in answer and (chunk := stalled.recv(4096)):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in answer
        stalled.close()
        info = httpx.get(f"{server.url}/server_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        assert info.json()["weight_version"] == 0
        held = [connect() for _ in range(12)]
        crowded = httpx.get(f"{server.url}/health", timeout=10)
        assert crowded.status_code == 503
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
