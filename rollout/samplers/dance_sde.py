"""DanceGRPO's SDE step (Xue et al., "DanceGRPO", arXiv 2505.07818): Euler-Maruyama with a constant
diffusion coefficient eta (the noise level) and the score term added to the drift.

std = eta * sqrt(sigma - sigma_next); x0 = x - sigma * v; score = -(x - (1 - sigma) * x0) / sigma^2
mean = x + dt * v - 0.5 * eta^2 * score * dt;  x' = mean + std * eps

The log-prob is the Gaussian density (DanceGRPO's), in both `log_prob_form`s: Flow-GRPO's code
writes the density for its Euler-Maruyama SDE, and "flow_grpo" applies that rule here.
`std_dev_t` is eta, the diffusion coefficient.
"""

from __future__ import annotations

import torch

from rollout.samplers.step_output import StepOutput, check_log_prob_form, gaussian_step, per_sample


def step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: torch.Tensor | float,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    log_prob_form: str = "gaussian",
) -> StepOutput:
    """Sample x' (or re-score `prev_sample`). x, v: [B, C, h, w]; sigmas, noise_level: scalars or [B]."""
    check_log_prob_form(log_prob_form)
    x = x.to(torch.float32)
    v = v.to(torch.float32)
    sigma = per_sample(sigma, x)
    sigma_next = per_sample(sigma_next, x)
    eta = per_sample(noise_level, x)
    dt = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    mean = x + dt * v - 0.5 * eta**2 * score * dt
    return gaussian_step(mean, eta * torch.sqrt(-dt), eta, noise, prev_sample)
