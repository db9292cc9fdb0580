"""Coefficients-preserving sampling (CPS): the DDIM-style stochastic step for flow matching, which
keeps the signal and noise coefficients of x' consistent with the schedule.

std_t = sigma_next * sin(a * pi / 2); x0 = x - sigma * v; x1 = x + (1 - sigma) * v
mean  = (1 - sigma_next) * x0 + sqrt(sigma_next^2 - std_t^2) * x1;  x' = mean + std_t * eps

The log-prob depends on `log_prob_form`: "gaussian" is the density of N(mean, std_t^2);
"flow_grpo" is what Flow-GRPO's code computes for CPS, -(x' - mean)^2 with every constant and the
1 / (2 std_t^2) factor dropped. Log-ratios of the two differ by that factor: a clip range tuned in
one form means something else in the other. `std_dev_t` is std_t (CPS has no sqrt(dt) factor).
At sigma_next = 0 the std is 0 and the step is the ODE's (x0), so the last step of a schedule is
never stochastic under CPS.
"""

from __future__ import annotations

import math

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
    std_t = sigma_next * torch.sin(per_sample(noise_level, x) * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + torch.sqrt(sigma_next**2 - std_t**2) * x1
    return gaussian_step(mean, std_t, std_t, noise, prev_sample, constant_free=log_prob_form == "flow_grpo")
