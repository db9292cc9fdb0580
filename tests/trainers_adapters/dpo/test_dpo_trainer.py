"""One online Diffusion-DPO update on real engine rollouts."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import SamplingParams
from trainers_adapters.dpo.trainer import DPOSettings, dpo_step
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards

pytestmark = pytest.mark.timeout(120)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


def test_dpo_starts_at_log_two_and_fits_its_pairs(engine, tiny_model):
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    params = SamplingParams(num_inference_steps=4, num_samples=4, seed=5, lora=policy.name, noise_level=0.7)
    with ThreadPoolExecutor(1) as pool:
        prompts = ["a red square", "a blue circle", "a red star"]
        rollout = generate_with_rewards(engine, prompts, params, colour_target, pool)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    settings = DPOSettings(beta=2000.0, micro_batch_size=2)

    first = dpo_step(policy, optimizer, rollout, settings, torch.Generator().manual_seed(0))
    assert first.num_pairs == 3
    assert first.reward_margin > 0
    # The policy starts as the reference (LoRA B = 0): every margin is 0 and the loss is log 2.
    assert first.loss == pytest.approx(math.log(2), abs=1e-6)
    assert first.grad_norm > 0

    # Repeated updates on the same pairs (same sigma and noise draws) fit them.
    for _ in range(10):
        last = dpo_step(policy, optimizer, rollout, settings, torch.Generator().manual_seed(0))
    assert last.loss < first.loss - 0.05
    assert last.accuracy > 0.5
    engine.unload_lora(policy.name)


def tie(images, prompts, metadata):
    return torch.zeros(len(prompts))


def test_groups_that_tie_give_no_pair_and_no_update(engine, tiny_model):
    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    params = SamplingParams(num_inference_steps=2, num_samples=2, seed=5, lora=policy.name)
    with ThreadPoolExecutor(1) as pool:
        rollout = generate_with_rewards(engine, ["a red square"], params, tie, pool)
    before = policy.lora_state()
    stats = dpo_step(policy, torch.optim.SGD(policy.parameters(), lr=1.0), rollout, DPOSettings(), torch.Generator())
    assert stats.num_pairs == 0
    assert all(torch.equal(before[k], v) for k, v in policy.lora_state().items())
    engine.unload_lora(policy.name)


def test_pairs_of_groups_of_two_output_sizes_train_in_one_step(engine, tiny_model):
    """Pairs of groups of different output sizes go in different forwards of one step."""
    import dataclasses

    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    rollouts = []
    with ThreadPoolExecutor(1) as pool:
        for prefix, height in (("small", 32), ("large", 48)):
            params = SamplingParams(num_inference_steps=2, num_samples=2, seed=5, lora=policy.name, height=height)
            rollouts.append(generate_with_rewards(engine, ["a red square"], params, colour_target, pool, prefix))
    small, large = rollouts
    mixed = dataclasses.replace(
        small,
        outputs=small.outputs + [dataclasses.replace(o, prompt_index=1) for o in large.outputs],
        rewards=torch.cat([small.rewards, large.rewards]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        reward_components={},
    )
    settings = DPOSettings(micro_batch_size=8)
    stats = dpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), mixed, settings, torch.Generator())
    assert stats.num_pairs == 2
    assert stats.loss == pytest.approx(math.log(2), abs=1e-6)
    engine.unload_lora(policy.name)
