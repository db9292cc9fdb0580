"""Update rules for one denoising step. Each module's `step` both samples and re-scores, so the
engine (sampling) and the trainer (recomputing log-probs) call the very same function.

step(x, v, sigma, sigma_next, noise_level, noise=None, prev_sample=None, log_prob_form="gaussian")
    -> StepOutput
"""

from __future__ import annotations

from collections.abc import Callable

from rollout.samplers import cps, dance_sde, flow_sde, ode
from rollout.samplers.step_output import LOG_PROB_FORMS, NoDensityError, StepOutput

SAMPLERS: dict[str, Callable[..., StepOutput]] = {
    "ode": ode.step,
    "flow_sde": flow_sde.step,
    "cps": cps.step,
    "dance_sde": dance_sde.step,
}


def get_sampler(name: str) -> Callable[..., StepOutput]:
    """The step function of sampler `name`."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {sorted(SAMPLERS)}")
    return SAMPLERS[name]


def is_stochastic_step(sampler: str, step_index: int, num_steps: int) -> bool:
    """Whether `sampler` injects noise at `step_index` (CPS is deterministic on the final step)."""
    if sampler == "ode":
        return False
    if sampler == "cps":
        return step_index < num_steps - 1
    return True


__all__ = ["LOG_PROB_FORMS", "SAMPLERS", "NoDensityError", "StepOutput", "get_sampler", "is_stochastic_step"]
