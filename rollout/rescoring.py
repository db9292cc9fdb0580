"""Re-score stored transitions: the trainer's side of the numerics contract.

The same adapter `predict_velocity` and the same sampler `step` that produced a trajectory compute
its log-probs again, now (optionally) with gradients through the model. Before any update the ratio
exp(new - old) is 1 up to float error: |log-ratio| < `RATIO_TOLERANCE`.

Only stochastic steps have a log-density. Scoring any other transition (an ODE step outside the
SDE window, CPS's last step, a step whose std is 0) raises `NoDensityError` instead of returning
NaN: one NaN log-prob turns every trained parameter into NaN at the next optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollout.condition import Condition
from rollout.guidance import Guidance, Scale, guidance_argument
from rollout.outputs import Trajectory
from rollout.samplers import RATIO_TOLERANCE as RATIO_TOLERANCE  # the contract, named where it is kept
from rollout.samplers import get_sampler
from rollout.samplers.step_output import NoDensityError, StepOutput


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
    log_prob_form: str = "gaussian",
    guidance: Guidance | None = None,
    guidance_scale: Scale = None,
    guidance_scale_2: Scale = None,
    true_cfg_scale: Scale = None,
) -> StepOutput:
    """Log-prob of `next_latents` given `latents` for a batch of transitions, with a fresh velocity.

    latents, next_latents: [B, *latent_shape] float32 of `height` x `width` images; sigmas,
    sigmas_next: [B]; conditions: one per transition; guidance (or its separate fields, as
    `predict_velocity` takes them) and `log_prob_form` as the trajectories recorded them.
    Gradients flow through the model when autograd is enabled.
    Raises `NoDensityError` for transitions without a density (checked after the forward, since
    the std comes from the sampler; `check_scorable` checks trajectory steps before it).
    """
    if sampler == "ode":
        raise NoDensityError(
            "sampler 'ode' has no log-density to score; only a stochastic sampler's steps can be scored "
            "(see trajectory.scorable_steps)"
        )
    velocity = adapter.predict_velocity(
        latents,
        sigmas,
        conditions,
        height=height,
        width=width,
        guidance=guidance_argument(
            guidance, guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, true_cfg_scale=true_cfg_scale
        ),
    )
    device = velocity.device
    return get_sampler(sampler)(
        latents.to(device),
        velocity,
        sigmas.to(device),
        sigmas_next.to(device),
        torch.as_tensor(noise_level, dtype=torch.float32, device=device),
        prev_sample=next_latents.to(device),
        log_prob_form=log_prob_form,
    )


def check_scorable(trajectories: Sequence[Trajectory], steps: Sequence[int]) -> None:
    """Raise `NoDensityError` if any (trajectory, step) pair is not among the trajectory's
    `scorable_steps` (ODE steps, CPS's last step, steps `record_steps` did not keep), naming the
    first and counting the others."""
    scorable: dict[int, set[int]] = {}  # per trajectory object: many pairs share one
    bad = []
    for number, (trajectory, step) in enumerate(zip(trajectories, steps, strict=True)):
        if id(trajectory) not in scorable:
            scorable[id(trajectory)] = set(trajectory.scorable_steps.tolist())
        if step not in scorable[id(trajectory)]:
            bad.append((number, step, trajectory))
    if not bad:
        return
    number, step, trajectory = bad[0]
    kind = "is not a step" if not 0 <= step < trajectory.num_steps else "has no log-density or was not kept"
    more = f" (and {len(bad) - 1} more pairs)" if len(bad) > 1 else ""
    raise NoDensityError(
        f"step {step} of trajectory {number} {kind}{more}: only stochastic steps whose transition the "
        f"trajectory keeps can be scored (ODE steps outside sde_window and CPS's last step have std 0). "
        f"Score the steps in trajectory.scorable_steps, here {trajectory.scorable_steps.tolist()}"
    )


def recompute_log_probs(adapter, trajectory: Trajectory, lora_scale: float | None = None) -> torch.Tensor:
    """Log-probs [T] float32 of the steps of `trajectory` (0 at ODE steps and at steps whose
    transition `record_steps` did not keep), computed in one batched forward over its stochastic steps.

    `lora_scale`: the strength the adapter's LoRA runs at now, where you set one yourself (PEFT's
    `set_adapters(name, [scale])`); None means full strength or no LoRA. A trajectory sampled at
    another `lora_scale` is refused: re-scored at the wrong strength, its ratio is not 1.
    (`LoraPolicy.score` sets each trajectory's scale itself.)"""
    sampled_at = 1.0 if trajectory.lora_scale is None else trajectory.lora_scale
    scoring_at = 1.0 if lora_scale is None else lora_scale
    if sampled_at != scoring_at:
        raise ValueError(
            f"the trajectory was sampled with its LoRA at lora_scale={sampled_at:g}, and this re-scores at "
            f"{scoring_at:g}: set the scale on your model (set_adapters(name, [{sampled_at:g}])) and "
            f"pass lora_scale={sampled_at:g}, or re-score with LoraPolicy.score, which runs each trajectory's scale"
        )
    steps = trajectory.scorable_steps
    log_probs = torch.zeros(trajectory.num_steps, dtype=torch.float32)
    if len(steps) == 0:
        return log_probs
    scored = score_steps(adapter, [trajectory] * len(steps), steps.tolist())
    log_probs[steps] = scored.log_prob.detach().cpu()
    return log_probs


def score_steps(adapter, trajectories: Sequence[Trajectory], steps: Sequence[int]) -> StepOutput:
    """The transition of step `steps[i]` of trajectory i, scored in one batched forward. The
    trajectories share their settings (image size, sampler, noise level, log-prob form, guidance)
    and each step is scorable: the caller checks both."""
    first = trajectories[0]
    pairs = list(zip(trajectories, steps, strict=True))
    return score_transitions(
        adapter,
        torch.stack([t.latents[s] for t, s in pairs]),
        torch.stack([t.latents[s + 1] for t, s in pairs]),
        torch.stack([t.sigmas[s] for t, s in pairs]),
        torch.stack([t.sigmas[s + 1] for t, s in pairs]),
        [t.condition for t in trajectories],
        first.sampler,
        first.noise_level,
        height=first.height,
        width=first.width,
        log_prob_form=first.log_prob_form,
        guidance=Guidance.of(first),
    )
