"""Off-policy corrections (`trainers_adapters.grpo.off_policy`): the formulas written out, and GRPO
updates on samples an older policy made, including a sample that crossed an update mid-trajectory."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import SamplingParams
from rollout.rescoring import RATIO_TOLERANCE
from rollout.weights.state import base_state
from trainers_adapters.grpo.loss import grpo_policy_loss
from trainers_adapters.grpo.off_policy import importance_weights
from trainers_adapters.grpo.trainer import GRPOSettings, grpo_step
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards

pytestmark = pytest.mark.timeout(180)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
PROMPTS = ["a red square", "a blue circle"]


def test_the_weights_are_the_formulas_of_the_docs():
    proximal = torch.tensor([0.0, 0.5, -0.2, 1.5, -1.0])
    behaviour = torch.tensor([0.0, 0.1, 0.3, 0.2, 0.0])
    cap = 2.0
    raw = [math.exp(p - b) for p, b in zip(proximal.tolist(), behaviour.tolist(), strict=True)]
    # none: 1; tis: min(w, C); rejection: 1 if 1/C <= w <= C else 0.
    expected = {
        "none": [1.0] * 5,
        "tis": [min(w, cap) for w in raw],
        "rejection": [1.0 if 1 / cap <= w <= cap else 0.0 for w in raw],
    }
    for correction, weights in expected.items():
        got = importance_weights(proximal, behaviour, correction, cap)
        assert got.weights.tolist() == pytest.approx(weights, rel=1e-6), correction
        assert got.raw.tolist() == pytest.approx(raw, rel=1e-6)
    assert importance_weights(proximal, behaviour, "tis", cap).corrected.tolist() == [w > cap for w in raw]
    assert importance_weights(proximal, behaviour, "rejection", cap).corrected.tolist() == [
        not 1 / cap <= w <= cap for w in raw
    ]
    with pytest.raises(ValueError, match="off_policy_correction must be one of"):
        importance_weights(proximal, behaviour, "vtrace", cap)


def test_the_weighted_loss_is_the_mean_of_weight_times_the_clipped_surrogate():
    new = torch.tensor([0.1, -0.3, 0.02, 0.0], requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.0, 0.05])
    advantages = torch.tensor([1.0, -2.0, 0.5, 1.5])
    weights = torch.tensor([2.0, 0.5, 0.0, 1.0])
    eps = 0.05
    loss, _ = grpo_policy_loss(new, old, advantages, eps, weights)
    terms = []
    for n, o, a, w in zip(new.tolist(), old.tolist(), advantages.tolist(), weights.tolist(), strict=True):
        r = math.exp(n - o)
        terms.append(w * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps)))
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-6)
    unweighted, _ = grpo_policy_loss(new, old, advantages, eps)
    assert torch.equal(unweighted, grpo_policy_loss(new, old, advantages, eps, torch.ones(4))[0])


def rollout_for(engine, policy, steps=4, seed=3):
    params = SamplingParams(num_inference_steps=steps, num_samples=4, seed=seed, lora=policy.name, noise_level=0.7)
    with ThreadPoolExecutor(1) as pool:
        return generate_with_rewards(engine, PROMPTS, params, colour_target, pool, f"off{seed}-")


@pytest.fixture
def policy_and_stale_rollout(engine, tiny_model):
    """A rollout of version v, the policy one large update later (version v + 1, pushed), and the
    adapter that sampled the rollout."""
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    version = policy.push(engine)
    sampled_with = policy.lora_state()
    rollout = rollout_for(engine, policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-2)
    grpo_step(policy, optimizer, rollout, GRPOSettings(clip_range=10.0), torch.Generator().manual_seed(0))
    assert policy.push(engine) == version + 1
    yield policy, rollout, version + 1, sampled_with
    engine.unload_lora(policy.name)


@pytest.mark.parametrize("correction", ["none", "tis", "rejection"])
def test_a_stale_rollout_trains_without_the_drift_check_and_reports_its_weights(policy_and_stale_rollout, correction):
    policy, rollout, version, _ = policy_and_stale_rollout
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    settings = GRPOSettings(off_policy_correction=correction, importance_cap=1.001, optimizer_steps=2)
    stats = grpo_step(policy, optimizer, rollout, settings, torch.Generator().manual_seed(1), policy_version=version)
    assert stats.staleness_mean == stats.staleness_max == 1
    assert stats.log_ratio_before_update is None  # no step of the policy's own version, no behaviour given
    assert max(stats.log_ratio_by_step_max.values()) > RATIO_TOLERANCE  # the lag of one update shows
    assert stats.importance_weight_min < 1 < stats.importance_weight_max
    if correction == "none":
        assert stats.corrected_fraction == 0
        assert stats.clip_fraction > 0.5  # Flow-GRPO's 1e-4 clip bounds the lag: most of it trains nothing
    else:
        assert 0 < stats.corrected_fraction <= 1  # some weights leave [1/1.001, 1.001]


def test_without_a_policy_version_the_same_stale_rollout_fails_the_drift_check(policy_and_stale_rollout):
    from trainers_adapters.grpo.trainer import PolicyDriftError

    policy, rollout, _, _ = policy_and_stale_rollout
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    with pytest.raises(PolicyDriftError):
        grpo_step(policy, optimizer, rollout, GRPOSettings(), torch.Generator().manual_seed(1))


def test_a_stale_rollout_is_held_to_the_contract_with_the_adapter_that_sampled_it(policy_and_stale_rollout):
    from trainers_adapters.grpo.trainer import PolicyDriftError

    policy, rollout, version, sampled_with = policy_and_stale_rollout
    trained = policy.lora_state()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)  # the policy stays as it is
    settings = GRPOSettings(off_policy_correction="tis", optimizer_steps=2, micro_batch_size=3)
    stats = grpo_step(
        policy, optimizer, rollout, settings, torch.Generator().manual_seed(1), version, {version - 1: sampled_with}
    )
    assert stats.log_ratio_before_update < RATIO_TOLERANCE  # the adapter that sampled gives the logged log-probs
    assert max(stats.log_ratio_by_step_max.values()) > RATIO_TOLERANCE  # the policy's lag of one update
    assert stats.behaviour_rescore_s > 0
    assert all(torch.equal(tensor, trained[key]) for key, tensor in policy.lora_state().items())  # swapped back
    # Another adapter than the one that sampled (here the policy's own) trips the guard, the policy unchanged.
    with pytest.raises(PolicyDriftError, match="a behaviour adapter is not the one the engine sampled its version"):
        grpo_step(
            policy, optimizer, rollout, settings, torch.Generator().manual_seed(1), version, {version - 1: trained}
        )
    assert all(torch.equal(tensor, trained[key]) for key, tensor in policy.lora_state().items())
    with pytest.raises(ValueError, match=rf"version\(s\) \[{version - 1}\] are stale, but behaviour holds"):
        grpo_step(policy, optimizer, rollout, settings, torch.Generator(), version, {version + 5: sampled_with})
    with pytest.raises(ValueError, match="does not fit policy"):
        grpo_step(
            policy, optimizer, rollout, settings, torch.Generator(), version, {version - 1: {"x": torch.zeros(1)}}
        )


def test_a_step_newer_than_the_policy_is_refused(policy_and_stale_rollout):
    policy, rollout, version, _ = policy_and_stale_rollout
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="newer than the policy's"):
        grpo_step(policy, optimizer, rollout, GRPOSettings(), torch.Generator(), policy_version=version - 2)


def test_a_sample_that_crossed_an_update_is_weighed_step_by_step_with_the_version_of_each(engine, tiny_model):
    """Base weights updated (mode="pause") after two of four steps: the first two steps' logged
    log-probs are the old model's, the last two the new one's, each re-scored to the contract by a
    policy holding that model; the update sees the later steps as its own (fresh) and the earlier
    ones as one version stale."""
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    torch.manual_seed(0)
    old_policy = LoraPolicy(tiny_model, LORA)  # the same adapter, on the base the engine starts with
    original = {name: t.detach().clone() for name, t in base_state(policy.adapter.transformer).items()}
    policy.push(engine)
    params = SamplingParams(num_inference_steps=4, num_samples=2, seed=5, lora=policy.name, noise_level=0.7)
    engine.add_request(PROMPTS[0], params, request_id="cross")
    engine.step()
    engine.step()
    changed = {name: tensor * 1.02 for name, tensor in original.items()}
    version = engine.update_weights(changed, mode="pause")
    policy.load_base_weights(changed)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    try:
        assert all(o.step_weight_versions == (version - 1, version - 1, version, version) for o in outputs)
        trajectories = [o.trajectory for o in outputs]
        for step, scorer in [(0, old_policy), (1, old_policy), (2, policy), (3, policy)]:
            with torch.no_grad():
                scored = scorer.score(trajectories, step)
            logged = torch.stack([t.log_probs[step] for t in trajectories])
            assert float((scored.log_prob - logged).abs().max()) < RATIO_TOLERANCE, step
        with torch.no_grad():
            lag = policy.score(trajectories, 0).log_prob - torch.stack([t.log_probs[0] for t in trajectories])
        assert float(lag.abs().max()) > RATIO_TOLERANCE  # the new model does not re-score the old steps
        stats = grpo_step(
            policy,
            torch.optim.AdamW(policy.parameters(), lr=1e-3),
            _rewarded(outputs),
            GRPOSettings(off_policy_correction="tis"),
            torch.Generator().manual_seed(0),
            policy_version=version,
        )
        assert stats.staleness_mean == 0.5 and stats.staleness_max == 1  # two steps of four are stale
        assert stats.log_ratio_before_update < RATIO_TOLERANCE  # over the fresh steps only
        assert stats.log_ratio_by_step_max[0] > RATIO_TOLERANCE > stats.log_ratio_by_step_max[3]
    finally:
        engine.update_weights(original)
        engine.unload_lora(policy.name)


def _rewarded(outputs):
    from trainers_adapters.rewards.rewarded_rollout import RewardedRollout

    outputs = sorted(outputs, key=lambda o: o.node_id)
    return RewardedRollout(
        outputs=outputs,
        rewards=torch.tensor([1.0, -1.0]),
        group_ids=torch.tensor([0, 0]),
        rollout_s=0.0,
        reward_wait_s=0.0,
    )
