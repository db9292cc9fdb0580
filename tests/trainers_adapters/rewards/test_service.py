"""The reward service over real HTTP (uvicorn in a thread of this process, the rewards on a thread of
it) and `RemoteReward` calling it: the key, safetensors and PNG bodies, a NaN refused naming the
reward, the same scores as in process, the service's components passed on to the rollout. The
command line with a reward worker runs in the slow suite."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
import uvicorn
from PIL import Image

from rollout import SamplingParams
from rollout.http.tensor_bytes import SAFETENSORS_MEDIA_TYPE, tensors_to_bytes
from rollout.serve.launch import free_port
from tests.threaded_server import served
from trainers_adapters.rewards.checks import RewardError
from trainers_adapters.rewards.composite import CompositeReward, RewardComponent
from trainers_adapters.rewards.remote import RemoteReward
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards
from trainers_adapters.rewards.runner import RewardsOnThreads
from trainers_adapters.rewards.service import parse_args
from trainers_adapters.rewards.service_app import RewardServiceSettings, build_reward_app
from trainers_adapters.rewards.spec import build_reward
from trainers_adapters.rewards.wire import encode_group

pytestmark = pytest.mark.timeout(120)

KEY = "test-key"
REWARD = {"colour": 1.0, "probe": {"reward": "tests.trainers_adapters.rewards.probe.Probe", "weight": 0.5}}


@pytest.fixture(scope="module")
def url():
    port = free_port()
    runner = RewardsOnThreads(build_reward(REWARD))
    app = build_reward_app(runner, list(REWARD), RewardServiceSettings(api_key=KEY, max_images=8))
    server = uvicorn.Server(uvicorn.Config(app, "127.0.0.1", port, log_level="warning"))
    with served(server, "the reward service"):
        yield f"http://127.0.0.1:{port}"
    runner.close()


def group(count: int = 3):
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (count, 3, 16, 16), dtype=torch.uint8, generator=generator)
    prompts = ["a red square"] * count
    metadata = [{"prompt_index": 0, "sample_index": k, "branch_path": [0, k]} for k in range(count)]
    return images, prompts, metadata


def post(url: str, body: bytes, key: str | None = KEY) -> httpx.Response:
    headers = {"content-type": SAFETENSORS_MEDIA_TYPE}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(f"{url}/score", content=body, headers=headers, timeout=30)


def in_process(images, prompts, metadata):
    return build_reward(REWARD).score(images, prompts, metadata)


def test_the_key_is_required(url):
    body = encode_group(*group())
    assert post(url, body, key=None).status_code == 401
    answer = post(url, body, key="wrong")
    assert answer.status_code == 403 and answer.json()["error"]["message"] == "wrong API key"
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "rewards": ["colour", "probe"]}


def test_safetensors_and_png_bodies_score_as_in_process(url):
    images, prompts, metadata = group()
    expected = in_process(images, prompts, metadata)
    answer = post(url, encode_group(images, prompts, metadata))
    assert answer.status_code == 200, answer.text
    assert torch.equal(torch.tensor(answer.json()["total"]), expected.total)
    assert list(answer.json()["components"]) == ["colour", "probe"]

    pngs = {}
    for i, image in enumerate(images):
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
        pngs[f"images.{i}.png"] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    request = '{"prompts": ["a red square", "a red square", "a red square"]}'  # metadata is optional
    answer = post(url, tensors_to_bytes(pngs, {"request": request}))
    assert answer.status_code == 200, answer.text
    assert torch.equal(torch.tensor(answer.json()["total"]), expected.total)


def test_a_nan_and_a_bad_body_are_refused_with_what_is_wrong(url):
    images, prompts, metadata = group()
    metadata[2]["nan"] = True
    answer = post(url, encode_group(images, prompts, metadata))
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "reward 'probe' returned nan for 1 of 3 samples (prompt 0 sample 2 branch [0, 2])" in message
    answer = post(url, b"not safetensors")
    assert answer.status_code == 400 and "not a valid safetensors file" in answer.json()["error"]["message"]
    answer = post(url, encode_group(*group(9)))
    assert answer.status_code == 400 and "at most 8 per request" in answer.json()["error"]["message"]


def test_a_remote_reward_equals_the_reward_in_process(url, monkeypatch):
    monkeypatch.setenv("REWARD_KEY_FOR_TEST", KEY)
    images, prompts, metadata = group()
    remote = build_reward({"judge": {"reward": "remote", "url": url, "api_key_env": "REWARD_KEY_FOR_TEST"}})
    scores = remote.score(images, prompts, metadata)
    assert torch.equal(scores.components["judge"], in_process(images, prompts, metadata).total)
    metadata[0]["nan"] = True
    with pytest.raises(RewardError, match=r"remote reward at .* answered 400: .*reward 'probe' returned nan"):
        remote.score(images, prompts, metadata)
    monkeypatch.setenv("REWARD_KEY_FOR_TEST", "wrong")
    wrong = CompositeReward([RewardComponent("judge", RemoteReward(url, api_key_env="REWARD_KEY_FOR_TEST"))])
    with pytest.raises(PermissionError, match="answered 403: wrong API key"):
        wrong.score(images, prompts, metadata)
    monkeypatch.delenv("REWARD_KEY_FOR_TEST")
    with pytest.raises(ValueError, match="the environment variable REWARD_KEY_FOR_TEST .* is not set"):
        RemoteReward(url, api_key_env="REWARD_KEY_FOR_TEST")


def test_a_remote_reward_passes_the_services_components_to_the_rollout(url, engine, monkeypatch):
    monkeypatch.setenv("REWARD_KEY_FOR_TEST", KEY)
    reward = build_reward(
        {"judge": {"reward": "remote", "url": url, "api_key_env": "REWARD_KEY_FOR_TEST"}, "colour": 0.1}
    )
    params = SamplingParams(num_inference_steps=2, num_samples=2, seed=5)
    rollout = generate_with_rewards(engine, ["a red square", "a blue star"], params, reward)
    components = rollout.reward_components
    assert list(components) == ["judge", "judge/colour", "judge/probe", "colour"]  # as the trainer logs them
    images = torch.stack([output.image for output in rollout.outputs])
    metadata = [{"prompt_index": o.prompt_index, "sample_index": o.sample_index} for o in rollout.outputs]
    local = in_process(images, [o.prompt for o in rollout.outputs], metadata)
    torch.testing.assert_close(components["judge/colour"], local.components["colour"], atol=0, rtol=0)
    torch.testing.assert_close(components["judge/probe"], local.components["probe"], atol=0, rtol=0)
    torch.testing.assert_close(components["judge"], local.total, atol=0, rtol=0)
    torch.testing.assert_close(rollout.rewards, local.total + 0.1 * components["colour"], atol=1e-6, rtol=0)


def test_the_command_line_checks_where_rewards_run_in_its_own_option_names(capsys):
    args = parse_args(["--reward", "colour", "--no-auth", "--workers", "2", "--devices", "cpu", "cpu"])
    assert (args.runner, args.devices, args.timeout_s) == ("process", ["cpu", "cpu"], 600.0)
    with pytest.raises(SystemExit):
        parse_args(["--reward", "colour", "--no-auth", "--runner", "ray", "--workers", "0", "--timeout-s", "-1"])
    error = capsys.readouterr().err
    assert "--runner 'ray' needs --workers >= 1" in error and "--timeout-s must be > 0 seconds" in error


@pytest.mark.slow  # a server process and its reward worker each import torch
@pytest.mark.timeout(300)
def test_the_command_line_serves_rewards_from_a_worker(monkeypatch):
    port = free_port()
    monkeypatch.setenv("REWARD_KEY_FOR_TEST", KEY)
    environment = {**os.environ, "REWARD_SERVICE_API_KEY": KEY}
    reward = "{colour: 1.0, probe: {reward: tests.trainers_adapters.rewards.probe.Probe, weight: 0.5}}"
    command = [sys.executable, "-m", "trainers_adapters.rewards.service", "--reward", reward, "--workers", "1"]
    command += ["--devices", "cpu", "--timeout-s", "120"]
    process = subprocess.Popen([*command, "--port", str(port)], env=environment)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, "the reward service exited"
            assert time.monotonic() < deadline, "the reward service did not answer"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        images, prompts, metadata = group()
        remote = RemoteReward(url, api_key_env="REWARD_KEY_FOR_TEST")
        assert torch.equal(remote(images, prompts, metadata), in_process(images, prompts, metadata).total)
    finally:
        process.terminate()
        assert process.wait(60) is not None
