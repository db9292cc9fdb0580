"""Re-score stored transitions: the trainer's side of the numerics contract.

The same adapter `predict_velocity` and the same sampler `step` that produced a trajectory compute
its log-probs again, now (optionally) with gradients through the model. Before any update the ratio
exp(new - old) is 1 up to float error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollout.outputs import Trajectory
from rollout.pipelines.condition import Condition
from rollout.samplers import StepOutput, get_sampler


def score_transitions(
    adapter,
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    sigmas: torch.Tensor,
    sigmas_next: torch.Tensor,
    conditions: Sequence[Condition],
    sampler: str,
    noise_level: torch.Tensor | float,
    *,
    height: int,
    width: int,
    guidance_scale: torch.Tensor | float | None = None,
    guidance_scale_2: torch.Tensor | float | None = None,
    true_cfg_scale: torch.Tensor | float | None = None,
) -> StepOutput:
    """Log-prob of `next_latents` given `latents` for a batch of transitions, with a fresh velocity.

    latents, next_latents: [B, *latent_shape] float32 of `height` x `width` images; sigmas,
    sigmas_next: [B]; conditions: one per transition; guidance as the trajectories recorded it.
    Gradients flow through the model when autograd is enabled.
    """
    velocity = adapter.predict_velocity(
        latents,
        sigmas,
        conditions,
        height=height,
        width=width,
        guidance_scale=guidance_scale,
        guidance_scale_2=guidance_scale_2,
        true_cfg_scale=true_cfg_scale,
    )
    device = velocity.device
    return get_sampler(sampler)(
        latents.to(device),
        velocity,
        sigmas.to(device),
        sigmas_next.to(device),
        torch.as_tensor(noise_level, dtype=torch.float32, device=device),
        prev_sample=next_latents.to(device),
    )


def recompute_log_probs(adapter, trajectory: Trajectory) -> torch.Tensor:
    """Log-probs [T] float32 of the steps of `trajectory` (0 at ODE steps and at steps whose
    transition `record_steps` did not keep), computed in one batched forward over its stochastic steps."""
    steps = trajectory.scorable_steps
    log_probs = torch.zeros(trajectory.num_steps, dtype=torch.float32)
    if len(steps) == 0:
        return log_probs
    scored = score_transitions(
        adapter,
        trajectory.latents[steps],
        trajectory.latents[steps + 1],
        trajectory.sigmas[steps],
        trajectory.sigmas[steps + 1],
        [trajectory.condition] * len(steps),
        trajectory.sampler,
        trajectory.noise_level,
        height=trajectory.height,
        width=trajectory.width,
        guidance_scale=trajectory.guidance_scale,
        guidance_scale_2=trajectory.guidance_scale_2,
        true_cfg_scale=trajectory.true_cfg_scale,
    )
    log_probs[steps] = scored.log_prob.detach().cpu()
    return log_probs
