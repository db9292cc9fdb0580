"""The hot-swap API over HTTP: weights and adapters pushed while requests run, with the versions the
outputs carry, and worker functions by name."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from rollout import SamplingParams
from rollout.pipelines.loading import load_adapter
from rollout.weights.state import base_state, checksum

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def transformer_state(tiny_model):
    return base_state(load_adapter(tiny_model).transformer)


def _drain(remote) -> list:
    outputs = []
    while remote.has_unfinished_requests():
        outputs += remote.step()
    return outputs


def test_weight_update_during_running_requests(remote, transformer_state):
    start = remote.weight_version
    new_state = {name: tensor + 0.01 for name, tensor in transformer_state.items()}
    remote.collective_rpc("set_step_delay", args=(0.02,))
    try:
        remote.add_request("before", SamplingParams(num_inference_steps=8, num_samples=2, seed=1), request_id="w0")
        time.sleep(0.1)
        version = remote.update_weights(new_state, mode="pause")  # lands between two steps
        remote.add_request("after", SamplingParams(num_inference_steps=2, seed=2), request_id="w1")
        outputs = {o.request_id: o for o in _drain(remote)}
    finally:
        remote.collective_rpc("set_step_delay", args=(0.0,))
    assert version == start + 1 == remote.weight_version
    assert outputs["w0-0"].weight_versions == (start, version)  # started on the old weights
    steps = outputs["w0-0"].step_weight_versions  # one per step, over the wire too
    assert len(steps) == 8 and steps == tuple(sorted(steps)) and set(steps) == {start, version}
    assert outputs["w1-0"].weight_versions == (version,)
    assert remote.weights_checksum() == checksum(new_state)
    # Back to the model's own weights (other tests of this module compare with in-process outputs).
    remote.update_weights(transformer_state, version=start)
    assert remote.weights_checksum() == checksum(transformer_state)


def test_a_push_streams_in_buckets_and_applies_bitwise(remote, transformer_state):
    """Buckets of one tensor or a few each, from an iterator read as the body goes out: the server
    holds exactly what was sent."""
    start = remote.weight_version
    torch.manual_seed(0)
    new_state = {name: torch.randn_like(tensor) for name, tensor in transformer_state.items()}
    pairs = iter(new_state.items())
    assert remote.update_weights(pairs, bucket_bytes=1 << 12) == start + 1  # many buckets
    assert remote.weights_checksum() == checksum(new_state)
    assert remote.update_weights(transformer_state, version=start) == start
    assert remote.weights_checksum() == checksum(transformer_state)


def test_refused_update_over_http_leaves_the_weights(remote, transformer_state):
    before = remote.weights_checksum()
    name = next(iter(transformer_state))
    with pytest.raises(ValueError, match="update refused, weights unchanged"):
        remote.update_weights({name: torch.zeros(3, 3)})
    assert remote.weights_checksum() == before


@pytest.fixture(scope="module")
def adapters(tiny_model):
    """Two random rank-2 adapters (PEFT keys) and their config."""
    transformer = load_adapter(tiny_model).transformer
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_v"], init_lora_weights=False)
    tensors = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        transformer.add_adapter(config, adapter_name=f"a{seed}")
        state = get_peft_model_state_dict(transformer, adapter_name=f"a{seed}")
        tensors.append({key: value.detach().clone() for key, value in state.items()})
        transformer.delete_adapters(f"a{seed}")
    return tensors, config


def test_lora_hot_swap_while_requests_run_and_unload(remote, engine, adapters):
    (first, second), config = adapters
    params = SamplingParams(num_inference_steps=6, num_samples=1, seed=3, lora="policy")
    v1 = remote.load_lora("policy", first, config)
    assert remote.list_loras() == ["policy"] and remote.lora_modules("policy") > 0
    remote.collective_rpc("set_step_delay", args=(0.02,))
    try:
        remote.add_request("lora", params, request_id="l0")
        time.sleep(0.05)
        v2 = remote.load_lora("policy", second, config)  # waits: running requests keep their adapter
        outputs = _drain(remote) + remote.generate("lora", params)
    finally:
        remote.collective_rpc("set_step_delay", args=(0.0,))
    assert v2 == v1 + 1
    assert [o.weight_versions for o in outputs] == [(v1,), (v2,)]
    # The same adapter in process gives the same sample, bitwise.
    engine.load_lora("policy", second, config)
    try:
        expected = engine.generate("lora", params)[0]
    finally:
        engine.unload_lora("policy")
    assert torch.equal(outputs[1].trajectory.latents.stack(), expected.trajectory.latents.stack())
    assert not torch.equal(outputs[0].trajectory.latents.stack(), outputs[1].trajectory.latents.stack())
    remote.unload_lora("policy")
    assert remote.list_loras() == []
    with pytest.raises(ValueError, match="lora 'policy' is not loaded"):
        remote.generate("lora", params)


def test_a_lora_whose_rank_is_not_its_configs_is_a_bad_request(remote, adapters):
    """Rank-2 tensors under a config of r=4, a new name: 400 with the engine's refusal naming the
    tensor (it was a 409 with PEFT's size-mismatch dump), and nothing loaded."""
    (first, _), config = adapters
    wider = dataclasses.replace(config, r=4, lora_alpha=8)
    with pytest.raises(ValueError, match=r"LoRA 'fresh' refused: \S+\.lora_[AB]\.weight expected \[\d+, \d+\], got"):
        remote.load_lora("fresh", first, wider)
    assert "fresh" not in remote.list_loras()


def test_lora_from_a_folder_on_the_server(remote, adapters, tmp_path):
    from safetensors.torch import save_file

    (first, _), config = adapters
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file(first, folder / "adapter_model.safetensors")
    config.save_pretrained(folder)
    remote.load_lora("from_disk", folder)
    try:
        assert "from_disk" in remote.list_loras()
    finally:
        remote.unload_lora("from_disk")


def test_update_from_disk_checksum_sleep_and_wake(remote, transformer_state, tmp_path):
    from safetensors.torch import save_file

    before = remote.weights_checksum()
    start = remote.weight_version
    save_file(transformer_state, tmp_path / "transformer.safetensors")
    assert remote.update_weights_from_disk(tmp_path / "transformer.safetensors") == start + 1
    assert remote.weights_checksum() == before == checksum(transformer_state)
    remote.sleep(1)
    assert remote.sleep_level == 1
    with pytest.raises(RuntimeError, match="asleep"):
        remote.generate("zzz", SamplingParams(num_inference_steps=1))
    remote.wake_up()
    assert remote.sleep_level == 0 and remote.weights_checksum() == before


def test_worker_functions_by_name_and_callables_refused(remote):
    assert remote.collective_rpc("get_rank") == [0]
    assert isinstance(remote.collective_rpc("pid")[0], int)
    with pytest.raises(ValueError, match="unknown worker method"):
        remote.collective_rpc("no_such_method")
    with pytest.raises(TypeError, match="cannot be sent over HTTP"):
        remote.collective_rpc(lambda worker: 1)
    with pytest.raises(TypeError, match=r"ranks must be a list of rank numbers \(e.g. \[1\]\)"):
        remote.collective_rpc("get_rank", ranks=1)
    with pytest.raises(ValueError, match=r"ranks names \[0\] more than once"):
        remote.collective_rpc("get_rank", ranks=[0, 0])
    with pytest.raises(ValueError, match=r"ranks must be a non-empty subset of 0..0, got \[1\]"):
        remote.collective_rpc("get_rank", ranks=[1])


def test_broadcast_group_through_the_server(remote, transformer_state):
    """The trainer (this process, rank 0) forms a gloo group with the server's worker and pushes;
    only the control calls cross HTTP."""
    from rollout.serve.launch import free_port
    from trainers_adapters.weights.broadcast import join_engine

    start = remote.weight_version
    broadcaster = join_engine(remote, "127.0.0.1", free_port())
    new_state = {name: tensor * 0.5 for name, tensor in transformer_state.items()}
    assert broadcaster.push(remote, new_state, bucket_bytes=1 << 16) == start + 1
    assert remote.weights_checksum() == checksum(new_state)
    with pytest.raises(ValueError, match="update refused"):
        remote.check_weight_update(["no.such.weight"], [torch.float32], [(2, 2)])
    remote.update_weights(transformer_state, version=start)


def test_non_finite_pushes_are_refused_over_http_and_the_opt_out_travels(remote, adapters, transformer_state):
    """What the engine refuses in process it refuses over HTTP, with its own message; the served
    adapter and weights stay. `check_finite=False` reaches the server (the NaN weights go in)."""
    (first, _), config = adapters
    params = SamplingParams(num_inference_steps=2, seed=4, lora="policy")
    version = remote.load_lora("policy", first, config)
    try:
        before = remote.generate("kept", params)[0]
        key = sorted(first)[0]
        diverged = {**first, key: torch.full_like(first[key], float("nan"))}
        with pytest.raises(ValueError, match="LoRA 'policy' refused: 1 of its tensors hold NaN"):
            remote.load_lora("policy", diverged, config)
        assert remote.weight_version == version
        after = remote.generate("kept", params)[0]
        assert torch.equal(after.image, before.image)
    finally:
        remote.unload_lora("policy")
    name = next(iter(transformer_state))
    digest = remote.weights_checksum()
    poisoned = {name: torch.full_like(transformer_state[name], float("inf"))}
    refused = f"update refused, weights unchanged: 1 problem.*\n  {re.escape(name)}: holds NaN"
    with pytest.raises(ValueError, match=refused):
        remote.update_weights(poisoned)
    assert remote.weights_checksum() == digest
    remote.update_weights(poisoned, check_finite=False)
    assert remote.weights_checksum() != digest
    remote.update_weights(transformer_state, version=version)
    assert remote.weights_checksum() == digest
