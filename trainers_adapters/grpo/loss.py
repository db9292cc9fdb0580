"""The GRPO objective over the SDE steps of diffusion trajectories (Flow-GRPO, arXiv 2505.05470).

Per stochastic step: ratio = exp(logp_new - logp_old); loss = max(-A * ratio, -A * clip(ratio,
1 - eps, 1 + eps)), averaged. The optional KL to the reference policy compares the two policies'
Gaussian transition means, mean((mean_theta - mean_ref)^2) / (2 s^2), in one of two forms that
differ in s (`KL_FORMS`):

- "flow_grpo": s is the step's `std_dev_t` as Flow-GRPO's step function returns it, which its
  training code divides by. For its SDE (flow_sde) that is the diffusion coefficient, without the
  sqrt(|dt|) of the transition std, so this KL is the exact one times |dt| (0.009 to 0.27 on a
  10-step SD3 schedule); for CPS it is the transition std, and the two forms agree.
- "gaussian": s is the transition std: the exact KL between the two Gaussian transitions (per
  element, as the log-probs are averaged).
A `kl_beta` taken from a paper means the paper's number only in the form of its code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.samplers import StepOutput
from trainers_adapters.grpo.settings import KL_FORMS  # the forms kl_to_reference computes


@dataclass
class GRPOStats:
    ratio_mean: float
    ratio_max_abs_log: float  # max |log ratio|: 0 before the first update
    clip_fraction: float


def grpo_policy_loss(
    log_prob_new: torch.Tensor,
    log_prob_old: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, GRPOStats]:
    """Clipped policy loss (scalar) over a batch of transitions [B], and statistics. `weights` [B]
    (no gradient): each transition's importance weight (`trainers_adapters.grpo.off_policy`), None: 1."""
    log_ratio = log_prob_new - log_prob_old.detach()
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach()
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    surrogate = torch.maximum(unclipped, clipped)
    loss = (surrogate if weights is None else weights.detach() * surrogate).mean()
    with torch.no_grad():
        stats = GRPOStats(
            ratio_mean=float(ratio.mean()),
            ratio_max_abs_log=float(log_ratio.abs().max()),
            clip_fraction=float(((ratio - 1.0).abs() > clip_range).float().mean()),
        )
    return loss, stats


def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """mean((m - m_ref)^2) / (2 std^2) per sample [B]: with the transition std, the KL between two
    Gaussians of that std (the "gaussian" form).

    mean, mean_ref: [B, C, h, w]; std: [B, 1, 1, 1]."""
    squared = ((mean - mean_ref.detach()) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return squared / (2 * std.reshape(-1) ** 2)


def kl_to_reference(scored: StepOutput, mean_ref: torch.Tensor, form: str) -> torch.Tensor:
    """The KL term per transition [B] in `form` (see `KL_FORMS` above): the policy's re-scored
    step `scored` against the reference's transition mean `mean_ref`."""
    if form == "flow_grpo":
        return gaussian_kl(scored.mean, mean_ref, scored.std_dev_t)
    if form == "gaussian":
        return gaussian_kl(scored.mean, mean_ref, scored.std)
    raise ValueError(f"KL form must be one of {KL_FORMS}, got {form!r}")
