"""Coefficients-preserving sampling (CPS): the DDIM-style stochastic step for flow matching, which
keeps the signal and noise coefficients of x' consistent with the schedule.

std_t = sigma_next * sin(a * pi / 2); x0 = x - sigma * v; x1 = x + (1 - sigma) * v
mean  = (1 - sigma_next) * x0 + sqrt(sigma_next^2 - std_t^2) * x1;  x' = mean + std_t * eps

The log-prob is the full Gaussian density. (Flow-GRPO's code drops the constants and the
1 / (2 std_t^2) factor for CPS, which rescales the policy ratio; we do not.) At sigma_next = 0 the
step is deterministic, so the last step of a schedule is never stochastic under CPS.
"""

from __future__ import annotations

import math

import torch

from rollout.samplers.step_output import StepOutput, gaussian_step, per_sample


def step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: torch.Tensor | float,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """Sample x' (or re-score `prev_sample`). x, v: [B, C, h, w]; sigmas, noise_level: scalars or [B]."""
    x = x.to(torch.float32)
    v = v.to(torch.float32)
    sigma = per_sample(sigma, x)
    sigma_next = per_sample(sigma_next, x)
    std_t = sigma_next * torch.sin(per_sample(noise_level, x) * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + torch.sqrt(sigma_next**2 - std_t**2) * x1
    return gaussian_step(mean, std_t, noise, prev_sample)
