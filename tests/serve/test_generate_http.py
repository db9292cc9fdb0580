"""Generation over HTTP: bitwise what the engine gives in process, every request answered once
under many concurrent clients, pauses and aborts that take effect, nothing left behind."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from rollout import NodeId, RemoteRolloutEngine, SamplingParams
from tests.serve.conftest import API_KEY

pytestmark = pytest.mark.timeout(240)

PARAMS = SamplingParams(num_inference_steps=4, num_samples=2, seed=11)


def assert_same_output(got, expected):
    """Equal in everything but timings and request ids (generate's ids count the engine's requests)."""
    assert (got.prompt, got.prompt_index, got.sample_index, got.seed, got.status) == (
        expected.prompt,
        expected.prompt_index,
        expected.sample_index,
        expected.seed,
        expected.status,
    )
    assert (got.weight_version, got.weight_versions, got.lora) == (
        expected.weight_version,
        expected.weight_versions,
        expected.lora,
    )
    assert got.branch_path == expected.branch_path
    for name in ("image", "latents"):
        assert (getattr(got, name) is None) == (getattr(expected, name) is None), name
        assert getattr(expected, name) is None or torch.equal(getattr(got, name), getattr(expected, name)), name
    a, b = got.trajectory, expected.trajectory
    assert set(a.records) == set(b.records)
    for name, series in {"latents": b.latents, **b.records}.items():
        got_series = a.latents if name == "latents" else a.records[name]
        assert torch.equal(got_series.positions, series.positions) and got_series.length == series.length, name
        assert torch.equal(got_series.stack(), series.stack()), name
    for name in ("log_probs", "timesteps", "sigmas", "sde_mask"):
        assert getattr(a, name).dtype == getattr(b, name).dtype
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("height", "width", "sampler", "noise_level", "guidance_scale", "true_cfg_scale"):
        assert getattr(a, name) == getattr(b, name), name
    for part, expected_embeds in b.condition.parts().items():  # an edit's encoded input images too
        got_embeds = getattr(a.condition, part)
        assert type(got_embeds) is type(expected_embeds), part
        if expected_embeds is None:
            continue
        for name, tensor in expected_embeds.tensors().items():
            assert torch.equal(got_embeds.tensors()[name], tensor), (part, name)


def test_generate_over_http_equals_in_process_bitwise(remote, engine):
    params = [PARAMS, SamplingParams(num_inference_steps=3, num_samples=1, seed=4, sampler="cps")]
    expected = engine.generate(["a red square", "a blue circle"], params)
    got = remote.generate(["a red square", "a blue circle"], params)
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected, strict=True):
        assert_same_output(g, e)
    # The samples of a prompt share one embedding tensor, as in process.
    assert got[0].trajectory.condition.prompt is got[1].trajectory.condition.prompt


def test_a_tree_with_records_and_latent_output_over_http_equals_in_process(remote, engine):
    params = SamplingParams(
        num_inference_steps=4,
        num_samples=2,
        seed=8,
        branch_steps=(1,),
        branch_factor=3,
        record=("x0", "mean", "std"),
        record_steps=(1, 2),
        output_type="latent",
        sigmas=(1.0, 0.7, 0.4, 0.2),
    )
    expected = engine.generate(["a tree"], params)
    got = remote.generate(["a tree"], params)
    assert [o.branch_path for o in got] == [(c,) for _ in range(2) for c in range(3)]
    group = got[0].group_id  # generate's ids count the engine's requests: the two fronts' differ
    assert [o.node_id for o in got] == [NodeId(group, k, (c,)) for k in range(2) for c in range(3)]
    assert all(o.request_id == str(o.node_id) for o in got)
    for g, e in zip(got, expected, strict=True):
        assert_same_output(g, e)
    assert got[0].trajectory.latents.parts[0] is got[2].trajectory.latents.parts[0]  # shared again on arrival
    for outputs in (got, expected):  # record_steps: kept entries are never lined up with steps by their order
        with pytest.raises(TypeError, match=r"series\[steps\] picks entries by chain position"):
            torch.stack([o.trajectory.latents for o in outputs])
        with pytest.raises(AttributeError, match=r"\.stack\(\)"):
            outputs[0].trajectory.records["x0"].clone()


def test_add_request_and_step_over_http_equal_in_process(remote, engine):
    expected = engine.add_request("green", PARAMS, prompt_index=3, request_id="g")
    expected_outputs = []
    while engine.has_unfinished_requests():
        expected_outputs += engine.step()
    ids = remote.add_request("green", PARAMS, prompt_index=3, request_id="g")
    assert ids == expected
    outputs = []
    while remote.has_unfinished_requests():
        outputs += remote.step()
    assert remote.step() == []
    outputs.sort(key=lambda o: o.sample_index)
    expected_outputs.sort(key=lambda o: o.sample_index)
    for g, e in zip(outputs, expected_outputs, strict=True):
        assert_same_output(g, e)
    assert [o.node_id for o in outputs] == [o.node_id for o in expected_outputs] == [NodeId("g", 0), NodeId("g", 1)]
    assert {o.group_id for o in outputs} == {"g"}


# 32 clients in the slow suite; 8 already interleave their requests in the one engine.
@pytest.mark.parametrize("clients", [8, pytest.param(32, marks=pytest.mark.slow)])
def test_concurrent_clients_each_get_every_answer_once(server, remote, clients):
    answers: dict[int, list] = {}
    errors = []

    def client(index):
        try:
            with RemoteRolloutEngine(server.url, api_key=API_KEY) as own:
                outputs = []
                for k in range(3):
                    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=index * 10 + k)
                    outputs += own.generate([f"client {index} request {k}"], params)
                answers[index] = outputs
        except Exception as error:  # reported below: a thread's exception would be lost
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(200)
    assert not errors
    assert sorted(answers) == list(range(clients))
    for index, outputs in answers.items():
        assert [(o.prompt, o.sample_index) for o in outputs] == [
            (f"client {index} request {k}", s) for k in range(3) for s in range(2)
        ]
        assert all(o.status == "finished" and o.trajectory.num_steps == 3 for o in outputs)
    info = remote.server_info()
    assert info["unfinished_requests"] == 0
    assert remote.collective_rpc("request_ids") == [[]]


def test_pause_keep_then_resume_gives_the_result_without_pause(remote, engine):
    params = SamplingParams(num_inference_steps=10, num_samples=2, seed=21)
    engine.add_request("held", params, request_id="held")
    expected = []
    while engine.has_unfinished_requests():
        expected += engine.step()
    expected.sort(key=lambda o: o.sample_index)
    remote.collective_rpc("set_step_delay", args=(0.03,))
    try:
        remote.add_request("held", params, request_id="held")
        time.sleep(0.15)
        remote.pause("keep")
        live = remote.collective_rpc("request_ids")
        time.sleep(0.3)
        assert remote.collective_rpc("request_ids") == live == [["held-0", "held-1"]]  # kept, not dropped
        assert remote.server_info()["paused"]
        remote.resume()
        outputs = []
        while remote.has_unfinished_requests():
            outputs += remote.step()
    finally:
        remote.collective_rpc("set_step_delay", args=(0.0,))
    outputs.sort(key=lambda o: o.sample_index)
    for g, e in zip(outputs, expected, strict=True):
        assert_same_output(g, e)


def test_abort_over_http_leaves_nothing_behind(remote):
    remote.add_request("stop me", SamplingParams(num_inference_steps=200, num_samples=3), request_id="stop")
    aborted = remote.abort("stop")
    assert sorted(o.request_id for o in aborted) == ["stop-0", "stop-1", "stop-2"]
    assert all(o.status == "aborted" and o.trajectory is None for o in aborted)
    assert not remote.has_unfinished_requests() and remote.step() == []
    assert remote.collective_rpc("request_ids") == [[]]


def test_a_request_id_another_client_holds_is_refused_saying_so(server, remote):
    """Two trainers on one server, each naming its eval "eval0": the second failed with
    "request_id 'eval0' is refused" and no word of another client. The server cannot tell its
    clients apart, so its message says the ids are shared; the client knows its own requests."""
    from rollout.errors import RequestIdTaken

    params = SamplingParams(num_inference_steps=200, num_samples=2)
    remote.add_request("mine", params, request_id="eval0")
    try:
        with RemoteRolloutEngine(server.url, api_key=API_KEY) as other:
            with pytest.raises(
                RequestIdTaken,
                match=r"request_id 'eval0' is refused: .*every client of a server, "
                r"shares its ids.*\(no unfinished request of this client holds it: another client of "
                rf"the server at {server.url} does\)",
            ):
                other.add_request("theirs", params, request_id="eval0")
            assert not other.has_unfinished_requests()
        with pytest.raises(
            ValueError, match=r"this client's own unfinished requests \['eval0-0', 'eval0-1'\] hold it"
        ):
            remote.add_request("mine again", params, request_id="eval0")
    finally:
        remote.abort("eval0")
    assert remote.collective_rpc("request_ids") == [[]]


def test_a_client_that_goes_away_aborts_its_requests(server, remote):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompts": ["abandoned"], "params": {"num_inference_steps": 400, "num_samples": 2}, "stream": True}
    with httpx.stream("POST", f"{server.url}/rollout/generate", json=body, headers=headers) as response:
        assert response.status_code == 200
        next(response.iter_raw())  # the first frame (the request ids) has arrived; then hang up
    deadline = time.monotonic() + 20
    while remote.server_info()["unfinished_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert remote.server_info()["unfinished_requests"] == 0
    assert remote.collective_rpc("request_ids") == [[]]


def test_a_call_past_timeout_s_is_a_timeout_error_and_its_requests_are_aborted(server, remote):
    remote.collective_rpc("set_step_delay", args=(0.05,))  # 400 steps: 20 s
    try:
        with RemoteRolloutEngine(server.url, api_key=API_KEY, timeout_s=1.0) as impatient:
            with pytest.raises(TimeoutError, match="did not answer within timeout_s"):
                impatient.generate("slow", SamplingParams(num_inference_steps=400, num_samples=2))
    finally:
        remote.collective_rpc("set_step_delay", args=(0.0,))
    deadline = time.monotonic() + 20  # the server sees the client hang up and aborts what it ran
    while remote.server_info()["unfinished_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert remote.server_info()["unfinished_requests"] == 0


def test_a_plain_http_client_reads_the_same_frames_without_streaming(server, remote):
    from rollout.http.wire import FRAMES_MEDIA_TYPE, FrameReader, OutputDecoder

    body = {"prompts": ["plain"], "params": {"num_inference_steps": 3, "num_samples": 2, "seed": 5}}
    response = httpx.post(
        f"{server.url}/rollout/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    assert response.status_code == 200 and response.headers["content-type"] == FRAMES_MEDIA_TYPE
    frames = list(FrameReader().feed(response.content))
    first, _ = frames[0]
    assert first["kind"] == "requests" and [i.rpartition("-")[2] for i in first["request_ids"]] == ["0", "1"]
    decoder = OutputDecoder()
    outputs = [o for o in (decoder.decode(fields, tensors) for fields, tensors in frames[1:]) if o is not None]
    expected = remote.generate("plain", SamplingParams(num_inference_steps=3, num_samples=2, seed=5))
    assert [o.sample_index for o in outputs] == [0, 1]  # in request order
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got.trajectory.latents.stack(), want.trajectory.latents.stack()) and torch.equal(
            got.image, want.image
        )


def test_add_request_with_a_prompt_index_and_no_id(remote, engine):
    expected = engine.add_request("indexed", PARAMS, prompt_index=2)
    expected_outputs = []
    while engine.has_unfinished_requests():
        expected_outputs += engine.step()
    ids = remote.add_request("indexed", PARAMS, prompt_index=2)
    assert [i.rpartition("-")[2] for i in ids] == [i.rpartition("-")[2] for i in expected]
    outputs = []
    while remote.has_unfinished_requests():
        outputs += remote.step()
    by_sample = lambda o: o.sample_index  # noqa: E731
    for g, e in zip(sorted(outputs, key=by_sample), sorted(expected_outputs, key=by_sample), strict=True):
        assert_same_output(g, e)
