"""Online Diffusion-DPO (Wallace et al., "Diffusion Model Alignment Using Direct Preference
Optimization", arXiv 2311.12908) in its flow-matching form.

The best and worst sample of each group form a pair (w, l). At a shared random sigma and noise,
each model's flow-matching error err = mean((v - (noise - x0))^2) is compared with the frozen
reference's: loss = -logsigmoid(-beta / 2 * ((err_w - err_l) - (err_w_ref - err_l_ref))).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def preference_pairs(rewards: torch.Tensor, group_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(winner index, loser index) per group: its highest and lowest reward. Groups whose rewards
    are all equal carry no preference and are skipped."""
    pairs = []
    for group in torch.unique(group_ids):
        members = (group_ids == group).nonzero(as_tuple=True)[0]
        group_rewards = rewards[members]
        if group_rewards.max() > group_rewards.min():
            pairs.append((int(members[group_rewards.argmax()]), int(members[group_rewards.argmin()])))
    return pairs


def flow_matching_error(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per-sample error [B] of a velocity prediction at x_t = (1 - sigma) x0 + sigma noise."""
    return ((velocity.float() - (noise - x0).float()) ** 2).mean(dim=tuple(range(1, velocity.ndim)))


def dpo_loss(
    err_w: torch.Tensor, err_l: torch.Tensor, err_w_ref: torch.Tensor, err_l_ref: torch.Tensor, beta: float
) -> torch.Tensor:
    """Diffusion-DPO loss (scalar) from per-pair errors [P] of the policy and the reference."""
    margin = (err_w - err_l) - (err_w_ref - err_l_ref).detach()
    return -F.logsigmoid(-beta / 2 * margin).mean()
