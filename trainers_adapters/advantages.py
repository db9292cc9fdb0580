"""Group-relative advantages for GRPO (Flow-GRPO / DanceGRPO style)."""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    global_std: bool = False,
    eps: float = 1e-4,
    clip_max: float = 5.0,
) -> torch.Tensor:
    """Advantages [N] float32: (r - mean of its group) / (std + eps), clipped to [-clip_max, clip_max].

    rewards: [N]; group_ids: [N] ints, equal for the samples of one prompt. The std is the group's
    own (population std), or with `global_std` the std over all rewards. A group whose rewards are
    all equal gets zero advantages (never NaN).
    """
    rewards = rewards.to(torch.float32).reshape(-1)
    group_ids = group_ids.reshape(-1)
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must match")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts)).index_add_(0, inverse, rewards)
    means = (sums / counts)[inverse]
    centred = rewards - means
    if global_std:
        std = rewards.std(unbiased=False).expand_as(rewards)
    else:
        variances = torch.zeros(len(counts)).index_add_(0, inverse, centred**2) / counts
        std = variances.sqrt()[inverse]
    return (centred / (std + eps)).clamp(-clip_max, clip_max)
