"""What one sampler step returns, and the Gaussian log-density every stochastic rule shares."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout.samplers import LOG_PROB_FORMS  # how a stochastic step's log-prob is written

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class NoDensityError(ValueError):
    """A transition without a log-density (std 0: an ODE step, CPS's last step, noise level 0) was
    given to be scored."""


@dataclass
class StepOutput:
    """One transition x_t -> x_{t-1} for a batch.

    prev_sample: [B, C, h, w] float32, the sampled (or given) next latents.
    log_prob: [B] float32, log-prob of prev_sample (in the step's `log_prob_form`), averaged over
        non-batch dims; None for ODE, and 0 for rows whose std is 0 (no density, as at ODE steps).
    mean: [B, C, h, w] float32, mean of the transition (equals prev_sample for ODE).
    std: [B, 1, 1, 1] float32, standard deviation of the transition (zeros for ODE).
    std_dev_t: [B, 1, 1, 1] float32, the step's noise scale as Flow-GRPO's step function returns
        it (its `std_dev_t`, which its KL divides by): for the Euler-Maruyama rules (flow_sde,
        dance_sde) the SDE's diffusion coefficient, std / sqrt(sigma - sigma_next); for CPS the
        std itself; zeros for ODE.
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    mean: torch.Tensor
    std: torch.Tensor
    std_dev_t: torch.Tensor


def per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar or a [B] vector to [B, 1, 1, ...] float32 matching `like`'s rank."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def check_log_prob_form(log_prob_form: str) -> None:
    if log_prob_form not in LOG_PROB_FORMS:
        raise ValueError(f"log_prob_form must be one of {LOG_PROB_FORMS}, got {log_prob_form!r}")


def gaussian_step(
    mean: torch.Tensor,
    std: torch.Tensor,
    std_dev_t: torch.Tensor,
    noise: torch.Tensor | None,
    prev_sample: torch.Tensor | None,
    constant_free: bool = False,
) -> StepOutput:
    """Sample (or re-score a given `prev_sample`) from N(mean, std^2), per element.

    The log-prob is averaged over all non-batch dims, as in Flow-GRPO and DanceGRPO, so its scale
    does not depend on the image size. `constant_free`: -(x' - mean)^2 instead of the density
    (Flow-GRPO's CPS form). Rows with std 0 have no density: sampled, they are the mean (the ODE's
    result) with log-prob 0; given a `prev_sample` to re-score, they raise `NoDensityError`.
    """
    has_density = std > 0
    if prev_sample is None:
        if noise is None:
            raise ValueError("a stochastic step needs either `noise` to sample or `prev_sample` to re-score")
        prev_sample = mean + std * noise.to(torch.float32)
    elif not bool(has_density.all()):
        rows = (~has_density).reshape(-1).nonzero().flatten().tolist()
        raise NoDensityError(
            f"{len(rows)} of the {mean.shape[0]} transitions to score have no log-density (std 0: an ODE step, "
            f"CPS's last step, or noise_level 0), at batch rows {rows[:8]}; score only the steps a trajectory "
            "lists in `trajectory.scorable_steps`"
        )
    prev_sample = prev_sample.to(torch.float32)
    squared = (prev_sample.detach() - mean) ** 2
    if constant_free:
        log_density = -squared
    else:
        safe_std = torch.where(has_density, std, torch.ones_like(std))  # no 0/0 in rows without density
        log_density = -squared / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    log_prob = log_density.mean(dim=tuple(range(1, log_density.ndim)))
    log_prob = torch.where(has_density.reshape(-1), log_prob, torch.zeros_like(log_prob))
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std, std_dev_t=std_dev_t)


def stochastic_step(rule: Callable, *, flow_grpo_drops_constants: bool = False) -> Callable[..., StepOutput]:
    """A sampler's `step` from its update rule: `rule(x, v, sigma, sigma_next, noise_level)` gets
    x and v in float32 and the rest per sample ([B, 1, 1, ...] float32), and returns the Gaussian's
    `(mean, std, std_dev_t)`, which `gaussian_step` samples from or re-scores with.
    `flow_grpo_drops_constants`: the "flow_grpo" log-prob form is -(x' - mean)^2 (CPS)."""

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
        mean, std, std_dev_t = rule(x, v, per_sample(sigma, x), per_sample(sigma_next, x), per_sample(noise_level, x))
        constant_free = flow_grpo_drops_constants and log_prob_form == "flow_grpo"
        return gaussian_step(mean, std, std_dev_t, noise, prev_sample, constant_free=constant_free)

    step.__module__ = rule.__module__
    return step
