"""Update rules for one denoising step. Each module's `step` both samples and re-scores, so the
engine (sampling) and the trainer (recomputing log-probs) call the very same function.

step(x, v, sigma, sigma_next, noise_level, noise=None, prev_sample=None, log_prob_form="gaussian")
    -> StepOutput

This package's own names are the samplers' facts (names, log-prob forms, which steps are
stochastic, the re-scoring contract) and import no torch: `SamplingParams` checks against them, and
a recipe's config check runs without torch. The step functions and `StepOutput` are imported when
first used (`get_sampler`, PEP 562 for the rest).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# One module of this package per sampler, named as the sampler.
SAMPLER_NAMES = ("ode", "flow_sde", "cps", "dance_sde")

# How a stochastic step's log-prob is written. "gaussian": the log-density of N(mean, std^2), per
# element. "flow_grpo": what Flow-GRPO's step function computes for the same rule: the Gaussian
# density for its SDE, and for CPS only -(x' - mean)^2, every constant and the 1 / (2 std^2)
# factor dropped (its `sde_type="cps"`), which scales CPS log-ratios by 2 std^2.
LOG_PROB_FORMS = ("gaussian", "flow_grpo")

# The numerics contract: before any update, re-scoring a stored transition with the policy that
# sampled it gives |log-ratio| below this (float32; the trainer's check and the tests use it).
RATIO_TOLERANCE = 1e-5


def get_sampler(name: str) -> Callable:
    """The step function of sampler `name` (-> `StepOutput`)."""
    if name not in SAMPLER_NAMES:
        raise ValueError(f"unknown sampler {name!r}; choose one of {sorted(SAMPLER_NAMES)}")
    return importlib.import_module(f"rollout.samplers.{name}").step


def is_stochastic_step(sampler: str, step_index: int, num_steps: int) -> bool:
    """Whether `sampler` injects noise at `step_index` (CPS is deterministic on the final step)."""
    if sampler == "ode":
        return False
    if sampler == "cps":
        return step_index < num_steps - 1
    return True


def __getattr__(name: str):
    # The names that need torch, imported on first use.
    if name == "SAMPLERS":
        return {sampler: get_sampler(sampler) for sampler in SAMPLER_NAMES}
    if name in ("NoDensityError", "StepOutput"):
        return getattr(importlib.import_module("rollout.samplers.step_output"), name)
    raise AttributeError(f"module 'rollout.samplers' has no attribute {name!r}")


__all__ = [
    "LOG_PROB_FORMS",
    "RATIO_TOLERANCE",
    "SAMPLERS",
    "SAMPLER_NAMES",
    "NoDensityError",
    "StepOutput",
    "get_sampler",
    "is_stochastic_step",
]
