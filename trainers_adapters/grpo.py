"""The GRPO objective over the SDE steps of diffusion trajectories (Flow-GRPO, arXiv 2505.05470).

Per stochastic step: ratio = exp(logp_new - logp_old); loss = max(-A * ratio, -A * clip(ratio,
1 - eps, 1 + eps)), averaged. The optional KL to the reference policy compares the two policies'
Gaussian transition means: mean((mean_theta - mean_ref)^2) / (2 std^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GRPOStats:
    ratio_mean: float
    ratio_max_abs_log: float  # max |log ratio|: 0 before the first update
    clip_fraction: float


def grpo_policy_loss(
    log_prob_new: torch.Tensor, log_prob_old: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, GRPOStats]:
    """Clipped policy loss (scalar) over a batch of transitions [B], and statistics."""
    log_ratio = log_prob_new - log_prob_old.detach()
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach()
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = GRPOStats(
            ratio_mean=float(ratio.mean()),
            ratio_max_abs_log=float(log_ratio.abs().max()),
            clip_fraction=float(((ratio - 1.0).abs() > clip_range).float().mean()),
        )
    return loss, stats


def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between two Gaussians with the same std, per sample [B]: mean((m - m_ref)^2) / (2 std^2).

    mean, mean_ref: [B, C, h, w]; std: [B, 1, 1, 1] (the transition std of the sampler step)."""
    squared = ((mean - mean_ref.detach()) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return squared / (2 * std.reshape(-1) ** 2)
