"""GRPO and DPO pieces against small hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from trainers_adapters.advantages import group_advantages
from trainers_adapters.dpo.loss import dpo_loss, flow_matching_error, preference_pairs
from trainers_adapters.grpo.loss import gaussian_kl, grpo_policy_loss

pytestmark = pytest.mark.timeout(30)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 3.0, 10.0, 10.0, 10.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    advantages = group_advantages(rewards, groups, eps=0.0 + 1e-4)
    # group 0: mean 2, population std 1 -> -1, +1 (up to eps); group 1: all equal -> 0; a group of one -> 0
    assert advantages[:2].tolist() == pytest.approx([-1 / (1 + 1e-4), 1 / (1 + 1e-4)])
    assert advantages[2:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert torch.isfinite(advantages).all()


def test_group_advantages_global_std_and_clipping():
    rewards = torch.tensor([0.0, 2.0, 4.0, 6.0])
    groups = torch.tensor([0, 0, 1, 1])
    advantages = group_advantages(rewards, groups, global_std=True)
    std = rewards.std(unbiased=False).item()  # sqrt(5)
    assert advantages.tolist() == pytest.approx([-1 / (std + 1e-4), 1 / (std + 1e-4)] * 2)
    clipped = group_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), eps=1e-9, clip_max=0.5)
    assert clipped.tolist() == [-0.5, 0.5]


def test_all_equal_rewards_give_zero_advantage_not_nan():
    advantages = group_advantages(torch.full((8,), 0.3), torch.arange(8) // 4)
    assert torch.equal(advantages, torch.zeros(8))


def test_grpo_loss_by_hand():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.1]))
    advantages = torch.tensor([1.0, 1.0, -1.0, -2.0])
    loss, stats = grpo_policy_loss(new, old, advantages, clip_range=0.2)
    # per sample max(-A r, -A clip(r)): [-1, -1.2, 0.8, 2.2]
    assert loss.item() == pytest.approx((-1 - 1.2 + 0.8 + 2.2) / 4)
    assert stats.clip_fraction == pytest.approx(0.5)
    loss_at_one, stats_at_one = grpo_policy_loss(old, old, advantages, clip_range=0.2)
    assert stats_at_one.ratio_max_abs_log == 0.0 and loss_at_one.item() == pytest.approx(-advantages.mean().item())


def test_grpo_gradient_follows_the_advantage():
    new = torch.zeros(2, requires_grad=True)
    loss, _ = grpo_policy_loss(new, torch.zeros(2), torch.tensor([1.0, -1.0]), clip_range=0.2)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([-0.5, 0.5])  # raise the good sample's log-prob


def test_gaussian_kl_by_hand():
    mean = torch.zeros(2, 1, 2, 2)
    ref = torch.ones(2, 1, 2, 2)
    std = torch.tensor([1.0, 2.0]).view(2, 1, 1, 1)
    assert gaussian_kl(mean, ref, std).tolist() == pytest.approx([0.5, 0.125])


def test_preference_pairs_pick_best_and_worst_and_skip_ties():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.2, 0.2, 0.2])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    assert preference_pairs(rewards, groups) == [(1, 0)]


def test_dpo_loss_by_hand():
    err_w, err_l = torch.tensor([0.2]), torch.tensor([0.5])
    err_w_ref, err_l_ref = torch.tensor([0.3]), torch.tensor([0.3])
    beta = 10.0
    margin = (0.2 - 0.5) - (0.3 - 0.3)
    expected = -math.log(1 / (1 + math.exp(beta / 2 * margin)))
    assert dpo_loss(err_w, err_l, err_w_ref, err_l_ref, beta).item() == pytest.approx(expected, rel=1e-6)
    # equal to the reference: log 2
    assert dpo_loss(err_w, err_l, err_w, err_l, beta).item() == pytest.approx(math.log(2))


def test_flow_matching_error_is_zero_for_the_true_velocity():
    x0, noise = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    assert torch.equal(flow_matching_error(noise - x0, x0, noise), torch.zeros(3))
