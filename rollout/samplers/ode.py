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
) -> StepOutput:
    """Euler step; `noise_level`, `noise` and `prev_sample` are ignored: the ODE has no density."""
    x = x.to(torch.float32)
    dt = per_sample(sigma_next, x) - per_sample(sigma, x)
    mean = x + v.to(torch.float32) * dt
    return StepOutput(prev_sample=mean, log_prob=None, mean=mean, std=torch.zeros_like(dt))
