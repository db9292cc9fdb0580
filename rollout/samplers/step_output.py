"""What one sampler step returns, and the Gaussian log-density every stochastic rule shares."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    """One transition x_t -> x_{t-1} for a batch.

    prev_sample: [B, C, h, w] float32, the sampled (or given) next latents.
    log_prob: [B] float32, log-density of prev_sample averaged over non-batch dims; None for ODE.
    mean: [B, C, h, w] float32, mean of the transition (equals prev_sample for ODE).
    std: [B, 1, 1, 1] float32, standard deviation of the transition (zeros for ODE).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    mean: torch.Tensor
    std: torch.Tensor


def per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar or a [B] vector to [B, 1, 1, ...] float32 matching `like`'s rank."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def gaussian_step(
    mean: torch.Tensor,
    std: torch.Tensor,
    noise: torch.Tensor | None,
    prev_sample: torch.Tensor | None,
) -> StepOutput:
    """Sample (or re-score a given `prev_sample`) from N(mean, std^2), per element.

    The log-prob is averaged over all non-batch dims, as in Flow-GRPO and DanceGRPO, so its scale
    does not depend on the image size.
    """
    if prev_sample is None:
        if noise is None:
            raise ValueError("a stochastic step needs either `noise` to sample or `prev_sample` to re-score")
        prev_sample = mean + std * noise.to(torch.float32)
    prev_sample = prev_sample.to(torch.float32)
    log_density = -((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    log_prob = log_density.mean(dim=tuple(range(1, log_density.ndim)))
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)
