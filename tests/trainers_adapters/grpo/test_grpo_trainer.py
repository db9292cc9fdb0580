"""One GRPO update on real engine rollouts: the ratio is one before the update, the update moves the
policy, and its options (minibatches, step subsets, KL) do what they say."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import SamplingParams
from rollout.rescoring import RATIO_TOLERANCE
from trainers_adapters.grpo.trainer import GRPOSettings, grpo_step
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards

pytestmark = pytest.mark.timeout(120)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
PROMPTS = ["a red square", "a blue circle"]


def rollout_for(engine, policy, steps=4, samples=4, request_prefix="rollout", **params):
    params = SamplingParams(
        num_inference_steps=steps, num_samples=samples, seed=3, lora=policy.name, noise_level=0.7, **params
    )
    with ThreadPoolExecutor(1) as pool:
        return generate_with_rewards(engine, PROMPTS, params, colour_target, pool, request_prefix)


def test_update_starts_at_ratio_one_and_moves_the_policy(engine, tiny_model):
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    version = policy.push(engine)
    rollout = rollout_for(engine, policy)
    assert all(o.weight_version == version for o in rollout.outputs)
    before = policy.lora_state()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    settings = GRPOSettings(optimizer_steps=2, micro_batch_size=5)
    stats = grpo_step(policy, optimizer, rollout, settings, torch.Generator().manual_seed(0))

    assert stats.log_ratio_before_update < RATIO_TOLERANCE
    assert stats.num_transitions == 8 * 4  # every SDE step of every sample
    # Per denoising step, over the first minibatch (half the transitions, shuffled: some of the 4 steps).
    by_max, by_mean = stats.log_ratio_by_step_max, stats.log_ratio_by_step_mean
    assert by_max and set(by_max) == set(by_mean) <= {0, 1, 2, 3}
    assert list(by_max) == sorted(by_max)
    assert all(by_mean[step] <= by_max[step] < RATIO_TOLERANCE for step in by_max)
    assert max(by_max.values()) == stats.log_ratio_before_update
    assert stats.grad_norm > 0 and stats.advantage_abs_mean > 0
    after = policy.lora_state()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # The second minibatch was scored after the first optimizer step: its ratios moved off one.
    assert stats.ratio_mean != 1.0
    assert policy.push(engine) == version + 1
    engine.unload_lora(policy.name)


def test_timestep_fraction_trains_on_a_random_subset_of_each_trajectory(engine, tiny_model):
    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    rollout = rollout_for(engine, policy, steps=6, sde_window=(0, 4))  # 4 SDE steps, 2 ODE steps
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    stats = grpo_step(policy, optimizer, rollout, GRPOSettings(timestep_fraction=0.5), torch.Generator())
    assert stats.num_transitions == 8 * 2  # half of the 4 SDE steps of each of the 8 samples
    engine.unload_lora(policy.name)


def test_a_rollout_of_two_output_sizes_trains_in_one_call_from_ratio_one(engine, tiny_model):
    """Edits of inputs of different sizes give outputs of different sizes; one re-scoring forward
    takes one size, so the micro-batches split by size (it used to refuse the whole rollout)."""
    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    small = rollout_for(engine, policy, steps=2, samples=2, height=32, width=32)
    large = rollout_for(engine, policy, steps=2, samples=2, request_prefix="large", height=48, width=32)
    moved = [dataclasses.replace(o, prompt_index=o.prompt_index + len(PROMPTS)) for o in large.outputs]
    mixed = dataclasses.replace(
        small,
        outputs=small.outputs + moved,
        rewards=torch.cat([small.rewards, large.rewards]),
        group_ids=torch.cat([small.group_ids, large.group_ids + len(PROMPTS)]),
        reward_components={},
    )
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    stats = grpo_step(policy, optimizer, mixed, GRPOSettings(micro_batch_size=16), torch.Generator().manual_seed(0))
    assert stats.num_transitions == sum(len(o.trajectory.scorable_steps) for o in mixed.outputs) >= 8
    assert stats.log_ratio_before_update < RATIO_TOLERANCE
    engine.unload_lora(policy.name)


def test_kl_to_the_reference_is_zero_for_a_zero_lora_and_positive_otherwise(engine, tiny_model):
    torch.manual_seed(1)
    policy = LoraPolicy(tiny_model, LORA)  # PEFT's default init: B = 0, so the policy is the base
    policy.push(engine)
    rollout = rollout_for(engine, policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    settings = GRPOSettings(kl_beta=0.5)
    assert grpo_step(policy, optimizer, rollout, settings, torch.Generator()).kl == 0.0

    random_lora = LoraPolicy(tiny_model, LORA | {"init_lora_weights": False})
    optimizer = torch.optim.SGD(random_lora.parameters(), lr=0.0)
    off_policy = dataclasses.replace(settings, max_log_ratio_before_update=None)  # on purpose: not the sampler
    stats = grpo_step(random_lora, optimizer, rollout, off_policy, torch.Generator())
    assert stats.kl > 0
    assert all(value > RATIO_TOLERANCE for value in stats.log_ratio_by_step_mean.values())  # every step drifts
    assert stats.loss == pytest.approx(stats.policy_loss + 0.5 * stats.kl, rel=1e-4, abs=1e-7)
    engine.unload_lora(policy.name)


def test_settings_report_every_bad_value():
    with pytest.raises(ValueError) as error:
        GRPOSettings(clip_range=0, timestep_fraction=1.5, optimizer_steps=0, max_grad_norm=-1)
    message = str(error.value)
    for name in ("clip_range", "timestep_fraction", "optimizer_steps", "max_grad_norm"):
        assert name in message


def test_the_drift_check_defaults_to_the_rescoring_contract():
    assert GRPOSettings().max_log_ratio_before_update == RATIO_TOLERANCE == 1e-5


def test_an_engine_update_the_policy_did_not_take_stops_the_update(engine, tiny_model):
    """The engine's base weights change and the policy's do not: the first update used to train on
    with a log ratio of ~1e-3 and most ratios clipped. It now raises, and taking the same weights
    (checked by checksum) makes it pass."""
    from rollout.weights.state import base_state
    from trainers_adapters.grpo.trainer import PolicyDriftError

    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    base = {n: t.detach().clone() for n, t in base_state(policy.adapter.transformer).items()}
    shifted = {n: t * 1.02 for n, t in base.items()}
    engine.update_weights(shifted)
    assert policy.weights_checksum() != engine.weights_checksum()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    before = policy.lora_state()
    with pytest.raises(PolicyDriftError, match="policy.load_base_weights"):
        grpo_step(policy, optimizer, rollout_for(engine, policy), GRPOSettings(), torch.Generator().manual_seed(0))
    assert all(torch.equal(before[k], v) for k, v in policy.lora_state().items())  # no step was taken

    policy.load_base_weights(shifted)
    assert policy.weights_checksum() == engine.weights_checksum()
    stats = grpo_step(policy, optimizer, rollout_for(engine, policy), GRPOSettings(), torch.Generator().manual_seed(0))
    assert stats.log_ratio_before_update < RATIO_TOLERANCE
    with pytest.raises(ValueError, match="base weights refused, policy unchanged: 1 problem"):
        policy.load_base_weights({"no.such.weight": torch.zeros(1)})
    engine.update_weights(base)
    engine.unload_lora(policy.name)


def test_a_tree_rollout_trains_each_shared_step_once_from_ratio_one(engine, tiny_model):
    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    # 2 roots x 2 x 2 leaves per prompt; steps 0-1 per root, 2-3 per branch, 4-5 per leaf.
    rollout = rollout_for(engine, policy, steps=6, samples=2, branch_steps=(2, 4), branch_factor=2)
    assert len(rollout.outputs) == 2 * 8 and rollout.branch_steps == (2, 4)
    assert [o.branch_path for o in rollout.outputs[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    stats = grpo_step(policy, optimizer, rollout, GRPOSettings(), torch.Generator())
    assert stats.log_ratio_before_update < RATIO_TOLERANCE
    per_prompt = 2 * 2 + 4 * 2 + 8 * 2  # each node's own steps, not once per leaf below it (6 x 8 = 48)
    assert stats.num_transitions == 2 * per_prompt
    # One minibatch holds every trained step: one entry per denoising step, each at ratio one.
    assert list(stats.log_ratio_by_step_max) == list(stats.log_ratio_by_step_mean) == list(range(6))
    assert all(value < RATIO_TOLERANCE for value in stats.log_ratio_by_step_max.values())
    engine.unload_lora(policy.name)


def test_branchgrpo_pruning_skips_the_pruned_steps_and_the_middle_leaves(engine, tiny_model):
    from trainers_adapters.grpo.trainer import _trained_nodes
    from trainers_adapters.grpo.tree import build_tree, tree_advantages

    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    rollout = rollout_for(engine, policy, steps=6, samples=2, branch_steps=(2, 4), branch_factor=2)
    settings = GRPOSettings(prune_steps=(0, 5), width_ratio=0.25)
    stats = grpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), rollout, settings, torch.Generator())
    assert stats.log_ratio_before_update < RATIO_TOLERANCE
    # Roots: step 1 only (0 pruned); branches: steps 2-3; 4 of the 16 leaves: step 4 only (5 pruned).
    assert stats.num_transitions == 2 * 2 * 1 + 2 * 4 * 2 + 4 * 1

    tree = build_tree(rollout.outputs, rollout.rewards, rollout.branch_steps, 6)
    advantages = tree_advantages(tree)
    leaves = [i for i, node in enumerate(tree.nodes) if node.depth == 2]
    kept = set(_trained_nodes(tree, advantages, 0.25)) & set(leaves)
    ranked = sorted(leaves, key=lambda i: -float(advantages[i]))
    assert kept == set(ranked[:2] + ranked[-2:])  # the best and the worst two
    assert set(_trained_nodes(tree, advantages, 1.0)) == set(range(len(tree.nodes)))
    with pytest.raises(ValueError, match="prune_steps must be step indices >= 0.*width_ratio must be in"):
        GRPOSettings(prune_steps=(-1,), width_ratio=0.0)
    engine.unload_lora(policy.name)


def test_a_rollout_the_policy_did_not_sample_is_refused_at_the_first_step(engine, tiny_model):
    """Sampling without lora=policy.name gave base-model rollouts; a fresh LoRA is the base, so the
    first step trained on them, and a PolicyDriftError one step later named causes that were not it."""
    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    with ThreadPoolExecutor(1) as pool:
        params = SamplingParams(num_inference_steps=2, num_samples=2, seed=3, noise_level=0.7)  # no lora=
        unadapted = generate_with_rewards(engine, PROMPTS, params, colour_target, pool, "unadapted")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    before = policy.lora_state()
    with pytest.raises(ValueError, match=r"adapter\(s\) \[None\].*SamplingParams\(lora='policy'\)"):
        grpo_step(policy, optimizer, unadapted, GRPOSettings(), torch.Generator().manual_seed(0))
    assert all(torch.equal(before[k], v) for k, v in policy.lora_state().items())
    engine.unload_lora(policy.name)


def test_a_rollout_at_a_lora_scale_rescores_at_that_scale_and_the_drift_error_names_it(engine, tiny_model):
    from trainers_adapters.grpo.trainer import PolicyDriftError

    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, {**LORA, "init_lora_weights": False})  # a LoRA that changes the samples
    version = policy.push(engine)
    rollout = rollout_for(engine, policy, steps=2, samples=2, lora_scale=0.5)
    assert {t.lora_scale for t in rollout.trajectories} == {0.5}
    assert {o.weight_version for o in rollout.outputs} == {version}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=5e-2)
    stats = grpo_step(policy, optimizer, rollout, GRPOSettings(kl_beta=0.04), torch.Generator().manual_seed(0))
    assert stats.log_ratio_before_update < RATIO_TOLERANCE  # today: the policy re-scored at scale 1
    assert stats.kl > 0  # the reference stays the base while the policy is at 0.5
    assert policy.adapter.transformer.transformer_blocks[0].attn.to_q.scaling[policy.name] == 2.0  # back to 1x
    stale = rollout_for(engine, policy, steps=2, samples=2, request_prefix="stale", lora_scale=0.5)  # not pushed
    with pytest.raises(PolicyDriftError, match=rf"weight version\(s\) \[{version}\] with lora_scale \[0.5\]"):
        grpo_step(policy, optimizer, stale, GRPOSettings(), torch.Generator().manual_seed(0))
    engine.unload_lora(policy.name)
