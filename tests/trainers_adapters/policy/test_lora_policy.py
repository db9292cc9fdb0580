"""The trainer's LoRA policy: re-scores engine rollouts with ratio one, and its gradients reach the
LoRA parameters only."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from rollout.rescoring import RATIO_TOLERANCE
from trainers_adapters.policy.lora_policy import LoraPolicy

pytestmark = pytest.mark.timeout(120)

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": False}


def test_policy_rescoring_is_ratio_one_and_trains_only_the_lora(engine, tiny_model):
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, CONFIG)
    version = policy.push(engine)
    params = SamplingParams(num_inference_steps=4, num_samples=3, seed=2, lora="policy")
    outputs = engine.generate(["a red square", "a blue circle"], params)
    assert all(o.weight_version == version for o in outputs)
    trajectories = [o.trajectory for o in outputs]
    for step in range(4):
        scored = policy.score(trajectories, step)
        old = torch.stack([t.log_probs[step] for t in trajectories])
        assert (scored.log_prob.detach() - old).abs().max() < RATIO_TOLERANCE
    with policy.reference():
        reference = policy.score(trajectories, 0)
    assert (reference.log_prob - torch.stack([t.log_probs[0] for t in trajectories])).abs().max() > 1e-4

    scored.log_prob.sum().backward()
    trainable = policy.parameters()
    assert trainable and all(p.grad is not None for p in trainable)
    frozen = [p for p in policy.adapter.transformer.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    engine.unload_lora("policy")


def test_ratio_is_one_with_a_bfloat16_model(tiny_model):
    """The base in bfloat16, the LoRA in float32 on both sides: a trained (non-zero) adapter re-scores
    to ratio one, which it did not while the engine kept its adapter in bfloat16 (|log ratio| ~2e-4)."""
    from rollout import EngineConfig, RolloutEngine

    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, CONFIG, dtype=torch.bfloat16)
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    with RolloutEngine(EngineConfig(model=tiny_model, dtype="bfloat16")) as engine:
        policy.push(engine)
        params = SamplingParams(num_inference_steps=3, num_samples=2, seed=2, lora="policy")
        trajectories = [o.trajectory for o in engine.generate(["a red square", "a blue circle"], params)]
    for step in range(3):
        with torch.no_grad():
            scored = policy.score(trajectories, step)
        old = torch.stack([t.log_probs[step] for t in trajectories])
        assert (scored.log_prob - old).abs().max() < RATIO_TOLERANCE


@pytest.mark.parametrize("family", ["sd3", "wan22"])  # wan22: a second expert, in a file of its own
def test_load_reads_back_what_save_wrote_bitwise(tiny_models, tmp_path, family):
    torch.manual_seed(0)
    saved = LoraPolicy(tiny_models(family), {"r": 4, "lora_alpha": 8, "init_lora_weights": False})
    saved.save(tmp_path / "lora")
    torch.manual_seed(1)  # another init: load must overwrite every tensor
    loaded = LoraPolicy(tiny_models(family), {"r": 4, "lora_alpha": 8, "init_lora_weights": False})
    before = loaded.lora_state()
    assert any(not torch.equal(before[key], t) for key, t in saved.lora_state().items())
    parameters = loaded.parameters()
    loaded.load(tmp_path / "lora")
    assert loaded.parameters() == parameters  # the same tensors, so an optimizer holding them goes on
    after = loaded.lora_state()
    assert after.keys() == saved.lora_state().keys()
    assert all(torch.equal(after[key], t) for key, t in saved.lora_state().items())


def test_load_refuses_a_folder_of_another_config_and_leaves_the_policy_unchanged(tiny_model, tmp_path):
    torch.manual_seed(0)
    LoraPolicy(tiny_model, {"r": 4, "lora_alpha": 16, "target_modules": ["to_q"]}).save(tmp_path / "other")
    policy = LoraPolicy(tiny_model, CONFIG)
    before = policy.lora_state()
    with pytest.raises(ValueError) as refused:
        policy.load(tmp_path / "other")
    message = str(refused.value)
    assert "lora config lora_alpha is 16, the policy's is 8" in message, message
    assert "target_modules" in message and "missing tensor" in message and "left unchanged" in message
    assert all(torch.equal(before[key], t) for key, t in policy.lora_state().items())
