"""Merged LoRA for rollouts: a forward runs its adapter merged into the base weights, the base comes
back bitwise, and rollouts re-score by the trainer's unmerged copy to ratio one (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel
from peft import LoraConfig

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.lora.manager import LoraManager
from rollout.lora.merge import merge_problems
from rollout.rescoring import RATIO_TOLERANCE
from rollout.weights.state import base_state, checksum
from trainers_adapters.policy.lora_policy import LoraPolicy

pytestmark = pytest.mark.timeout(120)

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": False}
PROMPTS = ["a red square", "a blue circle"]


def _merged(engine) -> tuple[str, float] | None:
    (state,) = engine.collective_rpc("hot_swap_state")  # read-only: it leaves a merge in place
    return state["merged_lora"]


def _latents(engine, **params) -> list[torch.Tensor]:
    params = SamplingParams(num_inference_steps=2, num_samples=2, seed=4, **params)
    return [output.trajectory.latents.stack() for output in engine.generate(PROMPTS[0], params)]


def _assert_close(merged: list[torch.Tensor], unmerged: list[torch.Tensor]) -> None:
    for a, b in zip(merged, unmerged, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(merged, unmerged): two engines on the tiny SD3 that differ only in `merge_lora`."""
    with (
        RolloutEngine(EngineConfig(model=tiny_model, merge_lora="always")) as merged,
        RolloutEngine(EngineConfig(model=tiny_model, merge_lora="never")) as unmerged,
    ):
        yield merged, unmerged


@pytest.fixture(scope="module")
def policy(tiny_model):
    """The trainer's copy (tests push changed tensors, never change it)."""
    torch.manual_seed(0)
    return LoraPolicy(tiny_model, CONFIG)


@pytest.fixture
def pushed(engines, policy):
    """`engines` with the policy's adapter pushed to each as "policy", unloaded after the test."""
    for engine in engines:
        policy.push(engine)
    yield engines
    for engine in engines:
        engine.unload_lora("policy")


def _stepped(policy: LoraPolicy, delta: float) -> dict[str, torch.Tensor]:
    """The policy's adapter after a stand-in for an optimizer step."""
    return {key: tensor + delta for key, tensor in policy.lora_state().items()}


def test_merged_rollouts_match_unmerged_and_rescore_to_ratio_one(pushed, policy):
    merged, unmerged = pushed
    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=2, lora="policy")
    outputs = merged.generate(PROMPTS, params)
    assert _merged(merged) == ("policy", 1.0) and _merged(unmerged) is None
    trajectories = [o.trajectory for o in outputs]
    worst = 0.0
    for step in range(3):
        with torch.no_grad():
            scored = policy.score(trajectories, step)
        old = torch.stack([t.log_probs[step] for t in trajectories])
        worst = max(worst, (scored.log_prob - old).abs().max().item())
    assert worst < RATIO_TOLERANCE  # measured 2.4e-7
    _assert_close(
        [t.latents.stack() for t in trajectories],
        [o.trajectory.latents.stack() for o in unmerged.generate(PROMPTS, params)],
    )
    # The base under the merged adapter is the trainer's, bitwise.
    assert merged.weights_checksum() == policy.weights_checksum()


def test_a_hot_swap_merges_the_new_values(pushed, policy):
    merged, unmerged = pushed
    before = _latents(merged, lora="policy")
    for engine in pushed:
        engine.load_lora("policy", _stepped(policy, 0.01), policy.lora_config)
    after = _latents(merged, lora="policy")
    assert (after[0] - before[0]).abs().max() > 1e-3  # the new adapter ran, not the merged old one
    _assert_close(after, _latents(unmerged, lora="policy"))


def test_an_update_while_merged_changes_the_base_and_the_next_forward_merges_into_it(pushed, policy):
    merged, unmerged = pushed
    _latents(merged, lora="policy")
    assert _merged(merged) == ("policy", 1.0)
    original = {name: tensor.detach().clone() for name, tensor in base_state(policy.adapter.transformer).items()}
    new = {name: tensor * 0.9 for name, tensor in original.items()}  # stands in for a full fine-tuning step
    for engine in pushed:
        engine.update_weights(new)
    assert _merged(merged) is None  # restored before the update swapped the base
    assert merged.weights_checksum() == checksum(new)
    _assert_close(_latents(merged, lora="policy"), _latents(unmerged, lora="policy"))
    for engine in pushed:
        engine.update_weights(original)


@pytest.mark.slow
def test_batches_of_different_adapters_each_run_their_own(engines, policy):
    """The scheduler never mixes adapters (or scales) in a forward; requests of several adapters
    and scales at once run one merge each, and match the unmerged engine's rows."""
    merged, unmerged = engines
    for engine in engines:
        policy.push(engine)
    for engine in engines:
        engine.load_lora("other", _stepped(policy, 0.02), policy.lora_config)
    params = [
        SamplingParams(num_inference_steps=2, seed=1, lora="policy"),
        SamplingParams(num_inference_steps=2, seed=1, lora="other"),
        SamplingParams(num_inference_steps=2, seed=1, lora="other", lora_scale=0.5),
        SamplingParams(num_inference_steps=2, seed=1),
    ]
    rows = {engine: [o.trajectory.latents.stack() for o in engine.generate(["x"] * 4, params)] for engine in engines}
    _assert_close(rows[merged], rows[unmerged])
    assert all((rows[merged][i] - rows[merged][i + 1]).abs().max() > 1e-4 for i in range(3))
    for engine in engines:
        engine.unload_lora("other")
        engine.unload_lora("policy")
    assert merged.weights_checksum() == unmerged.weights_checksum()


def test_switching_adapters_restores_before_merging_the_next(tiny_model, policy):
    transformer = SD3Transformer2DModel.from_pretrained(Path(tiny_model) / "transformer")
    loras = LoraManager({"transformer": transformer}, merge=True)
    loras.stage("a", policy.lora_state(), policy.lora_config)
    loras.commit("a")
    loras.stage("b", _stepped(policy, 0.05), policy.lora_config)
    loras.commit("b")
    layer = transformer.transformer_blocks[0].attn.to_q
    base = layer.base_layer.weight.detach().clone()
    for name in ("a", "b", "a"):
        loras.activate(name, 0.5)
        assert loras.merged == (name, 0.5)
        layer.set_scale(loras._layers[name], 0.5)
        expected = base + layer.get_delta_weight(loras._layers[name])  # the one adapter's delta, never both
        torch.testing.assert_close(layer.base_layer.weight, expected, rtol=0, atol=1e-6)
    loras.activate(None, 1.0)
    assert loras.merged is None and torch.equal(layer.base_layer.weight, base)


@pytest.mark.slow
def test_a_function_run_on_the_workers_sees_and_changes_the_base(pushed, policy):
    """collective_rpc of a user's function undoes the merge first: it reads the base weights, and
    what it writes into them stays (the next forward merges into the written base)."""
    merged, unmerged = pushed
    params = {"lora": "policy"}
    _latents(merged, **params)
    assert _merged(merged) == ("policy", 1.0)
    name = "transformer_blocks.0.attn.to_q.weight"

    def read(worker):
        return base_state(worker.adapter.denoisers["transformer"])[name].clone()

    def scale(worker):
        with torch.no_grad():
            base_state(worker.adapter.denoisers["transformer"])[name].mul_(1.5)

    (seen,) = merged.collective_rpc(read)
    (base,) = unmerged.collective_rpc(read)
    assert torch.equal(seen, base) and _merged(merged) is None
    for engine in pushed:
        engine.collective_rpc(scale)
    _assert_close(_latents(merged, **params), _latents(unmerged, **params))
    assert merged.weights_checksum() == unmerged.weights_checksum()
    for engine in pushed:  # the module's engines go on with the base they started with
        engine.update_weights({name: base})


def test_500_merge_restore_cycles_leave_the_base_bitwise(tiny_model, policy):
    transformer = SD3Transformer2DModel.from_pretrained(Path(tiny_model) / "transformer")
    loras = LoraManager({"transformer": transformer}, merge=True)
    loras.stage("a", policy.lora_state(), policy.lora_config)
    loras.commit("a")
    digest = checksum(base_state(transformer))
    weight = transformer.transformer_blocks[0].attn.to_q.base_layer.weight
    base, pointer = weight.detach().clone(), weight.data_ptr()
    for cycle in range(500):
        loras.activate("a", 1.0 if cycle % 2 else 0.5)
        assert loras.merged == ("a", 1.0 if cycle % 2 else 0.5) and not torch.equal(weight, base)
        if cycle % 3:
            loras.restore()
        else:
            loras.activate(None, 1.0)  # the base model: restored too
        assert loras.merged is None and weight.data_ptr() == pointer
    assert torch.equal(weight, base)
    assert checksum(base_state(transformer)) == digest


def test_merging_off_keeps_the_peft_layers(policy, engines):
    _, unmerged = engines
    policy.push(unmerged)
    _latents(unmerged, lora="policy")
    assert _merged(unmerged) is None
    unmerged.unload_lora("policy")


def test_only_plain_lora_on_linear_layers_merges(tiny_model):
    transformer = SD3Transformer2DModel.from_pretrained(Path(tiny_model) / "transformer")
    transformer.add_adapter(LoraConfig(**CONFIG), adapter_name="plain")
    transformer.add_adapter(LoraConfig(**CONFIG, use_dora=True), adapter_name="dora")
    assert merge_problems(transformer, "plain") == []
    (problem,) = merge_problems(transformer, "dora")
    assert problem.startswith("DoraLinearVariant layers (DoRA and other variants do not merge): transformer_blocks.0")


def test_merge_lora_defaults_by_dtype_and_checks_its_value(tiny_model):
    assert EngineConfig(model=tiny_model).merges_lora
    assert not EngineConfig(model=tiny_model, dtype="bfloat16").merges_lora
    assert not EngineConfig(model=tiny_model, dtype="float16").merges_lora
    assert EngineConfig(model=tiny_model, dtype="bfloat16", merge_lora="always").merges_lora
    assert not EngineConfig(model=tiny_model, merge_lora="never").merges_lora
    with pytest.raises(ValueError, match="merge_lora must be one of auto, always, never, got 'on'"):
        EngineConfig(model=tiny_model, merge_lora="on")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_merged_half_precision_breaks_the_ratio_contract_that_unmerged_keeps(tiny_model, dtype):
    """Why 'auto' does not merge in bfloat16 or float16: the merged weights' rounding moves the
    log-probs past the tolerance (measured 7.9e-4 in bfloat16, 1.4e-4 in float16 on CPU), while the
    unmerged path re-scores exactly."""
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, CONFIG, dtype=getattr(torch, dtype))
    worst = {}
    for merge in ("always", "never"):
        with RolloutEngine(EngineConfig(model=tiny_model, dtype=dtype, merge_lora=merge)) as engine:
            policy.push(engine)
            params = SamplingParams(num_inference_steps=3, num_samples=2, seed=2, lora="policy")
            trajectories = [o.trajectory for o in engine.generate(PROMPTS, params)]
        with torch.no_grad():
            scored = [policy.score(trajectories, step).log_prob for step in range(3)]
        old = [torch.stack([t.log_probs[step] for t in trajectories]) for step in range(3)]
        worst[merge] = max((s - o).abs().max().item() for s, o in zip(scored, old, strict=True))
    assert worst["never"] < RATIO_TOLERANCE < worst["always"]
