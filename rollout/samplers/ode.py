"""Deterministic Euler step of the flow ODE: x' = x + v * (sigma_next - sigma)."""

from __future__ import annotations

import torch

from rollout.samplers.step_output import StepOutput, per_sample


def step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: torch.Tensor | float = 0.0,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    log_prob_form: str = "gaussian",
) -> StepOutput:
    """Euler step; `noise_level`, `noise`, `prev_sample` and `log_prob_form` are ignored: the ODE
    has no density (scoring goes through a stochastic rule, which refuses std 0)."""
    x = x.to(torch.float32)
    dt = per_sample(sigma_next, x) - per_sample(sigma, x)
    mean = x + v.to(torch.float32) * dt
    zero = torch.zeros_like(dt)
    return StepOutput(prev_sample=mean, log_prob=None, mean=mean, std=zero, std_dev_t=zero)
