"""Re-score stored transitions: the trainer's side of the numerics contract.

The same adapter `predict_velocity` and the same sampler `step` that produced a trajectory compute
its log-probs again, now (optionally) with gradients through the model. Before any update the ratio
exp(new - old) is 1 up to float error.
"""

from __future__ import annotations

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
    condition: Condition,
    guidance_scale: torch.Tensor | float,
    sampler: str,
    noise_level: torch.Tensor | float,
) -> StepOutput:
    """Log-prob of `next_latents` given `latents` for a batch of transitions, with a fresh velocity.

    latents, next_latents: [B, C, h, w] float32; sigmas, sigmas_next: [B]; condition batched.
    Gradients flow through the model when autograd is enabled.
    """
    velocity = adapter.predict_velocity(latents, sigmas, condition, guidance_scale)
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
    """Log-probs [T] float32 of every step of `trajectory` (0 where `sde_mask` is False), computed
    in one batched forward over its stochastic steps."""
    steps = trajectory.sde_mask.nonzero(as_tuple=True)[0]
    log_probs = torch.zeros(trajectory.num_steps, dtype=torch.float32)
    if len(steps) == 0:
        return log_probs
    condition = Condition.stack([trajectory.condition] * len(steps))
    scored = score_transitions(
        adapter,
        trajectory.latents[steps],
        trajectory.latents[steps + 1],
        trajectory.sigmas[steps],
        trajectory.sigmas[steps + 1],
        condition,
        trajectory.guidance_scale,
        trajectory.sampler,
        trajectory.noise_level,
    )
    log_probs[steps] = scored.log_prob.detach().cpu()
    return log_probs
