"""Requests a careless or hostile client sends to the shared server that the engine's own checks
must refuse at admission: a request_id in the engine's own namespace (which made another client's
plain generate fail), a schedule that ends in a NaN log-prob, a push that takes the weight version
back. Each is refused within a second naming the rule, while a good request beside it gives the
bytes it gives alone and /health answers."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from rollout import SamplingParams
from rollout.http.wire import SAFETENSORS_MEDIA_TYPE, tensors_to_bytes
from tests.serve.conftest import API_KEY
from tests.serve.probing import HEALTH_BOUND_S, HealthWatch, refused_beside_a_good_request

pytestmark = pytest.mark.timeout(240)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = SamplingParams(num_inference_steps=4, seed=13)


def timed_post(server, path: str, **kwargs) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = httpx.post(f"{server.url}{path}", headers={**AUTH, **kwargs.pop("headers", {})}, timeout=60, **kwargs)
    return response, time.monotonic() - start


def test_a_client_cannot_take_the_id_the_engine_gives_another_client_s_request_next(server, remote):
    """A asks for request_id "req<n+1>" after seeing its own "req<n>": once, B's plain generate got
    that id next and was refused as a clash (400). Ids of that form are the engine's alone."""
    remote.collective_rpc("set_step_delay", args=(0.05,))
    try:
        start = time.monotonic()
        (alone,) = remote.generate("fine", GOOD)
        alone_s = time.monotonic() - start
        taken = f"req{int(alone.group_id.removeprefix('req')) + 1}"
        bad = {"prompts": "x", "params": {"num_inference_steps": 4, "seed": 0}, "request_id": taken}
        with HealthWatch(server.url) as health, ThreadPoolExecutor(1) as pool:
            sent = pool.submit(timed_post, server, "/rollout/generate", json=bad)
            time.sleep(0.1)  # A's request first
            (beside,) = remote.generate("fine", GOOD)
            response, refused_s = sent.result(timeout=60)
    finally:
        remote.collective_rpc("set_step_delay", args=(0.0,))
    assert response.status_code == 400, response.text
    assert f"request_id {taken!r} has the form of an id the engine makes" in response.json()["error"]["message"]
    assert refused_s < max(1.0, 2 * alone_s), (refused_s, alone_s)  # a loaded machine slows both alike
    assert beside.group_id == taken  # B got the id A asked for, as it would have without A
    assert torch.equal(beside.image, alone.image)
    assert torch.equal(beside.trajectory.latents.stack(), alone.trajectory.latents.stack())
    assert health.failures == 0 and health.worst_s < HEALTH_BOUND_S, vars(health)
    sample = {**bad, "request_id": f"{taken}-0"}  # a sample id of that form clashes as well
    assert "has the form of an id the engine makes" in timed_post(server, "/rollout/generate", json=sample)[0].text


def test_a_schedule_whose_log_prob_is_not_a_number_is_refused(server, remote):
    """sigmas=[1e-30] finished with a NaN log-prob: the step's variance underflows in float32."""
    bad = {"prompts": "x", "params": {"num_inference_steps": 1, "sigmas": [1e-30], "seed": 0}}
    refused_beside_a_good_request(
        server,
        remote,
        lambda: remote.generate("fine", GOOD),
        lambda: timed_post(server, "/rollout/generate", json=bad),
        400,
        "sigmas must decrease strictly and lie in [1e-05, 1] (below 1e-05 a step's noise is lost to float32 "
        "rounding and its log-prob is not a number), got (1e-30,)",
    )


def test_a_push_may_not_take_the_weight_version_back(server, remote, tiny_model):
    """17, then -5: refused naming the current version, before the push waits for running requests
    or stages anything; a version the server held before (a resumed trainer's) is taken."""
    from rollout.pipelines.loading import load_adapter

    name, tensor = next(iter(load_adapter(tiny_model).transformer.state_dict().items()))
    start, digest = remote.weight_version, remote.weights_checksum()
    assert remote.update_weights({name: tensor}, version=start + 17) == start + 17  # the same values
    options = {"request": json.dumps({"version": -5})}
    body = tensors_to_bytes({name: tensor}, options)
    try:
        refused_beside_a_good_request(
            server,
            remote,
            lambda: remote.generate("fine", GOOD),
            lambda: timed_post(
                server, "/update_weights_from_tensor", content=body, headers={"content-type": SAFETENSORS_MEDIA_TYPE}
            ),
            400,
            f"version -5 is below this engine's weight version {start + 17}, and no weights it held had it",
        )
        with pytest.raises(ValueError, match=f"version -5 is below this engine's weight version {start + 17}"):
            remote.load_lora("policy", {}, {"r": 2, "target_modules": ["to_q"]}, version=-5)
        assert remote.weight_version == start + 17 and remote.weights_checksum() == digest
    finally:
        assert remote.update_weights({name: tensor}, version=start) == start  # held before: taken
