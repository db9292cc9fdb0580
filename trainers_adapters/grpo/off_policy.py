"""Off-policy corrections of a GRPO update whose samples an older policy made (asynchronous
training with bounded staleness, `recipes.async_rollouts`).

Each trained transition (sample i, denoising step t: x_t -> x_{t+1}) has three log-probs, each a
mean over the latent's elements as Flow-GRPO's are:

- behaviour `b`: logged by the engine while it sampled (`trajectory.log_probs[t]`), computed with
  the weights of the version that ran that step (`RolloutOutput.step_weight_versions[t]`), so a
  sample that crossed an update mid-trajectory is weighed step by step with the right policy. It is
  reused, never recomputed, so it is checked: given the adapter of that version, the trainer
  re-scores the step with it, without gradient, and must find b again (`behaviour_log_ratio`: the
  re-scoring contract, |log ratio| < 1e-5, as for the policy's own steps);
- proximal `p`: the trainer's policy at the start of this update, without gradient (for the first
  minibatch the detached value of the forward that trains; later minibatches are re-scored before
  the first optimizer step: one extra forward of theirs, none with `optimizer_steps=1`);
- current `theta`: the policy being trained, with gradient.

The importance weight of the step is w = exp(p - b). The corrections (`GRPOSettings.off_policy_correction`):

- `none`: PPO's ratio r = exp(theta - b), clipped to [1 - eps, 1 + eps]; no weight. This is
  Flow-GRPO's on-policy loss (there p = b), and with stale samples verl's "bypass" mode: the clip
  then also bounds the policy lag, so a sample older than the clip range trains nothing.
- `tis`: decoupled PPO (Hilton et al., arXiv 2110.00641): r = exp(theta - p), clipped, times
  min(w, C) without gradient: truncated importance sampling (Yao et al., "Your efficient RL framework
  secretly brings you off-policy RL training", 2025; verl's rollout correction, `truncate` mode,
  token level: here a denoising step).
- `rejection`: the same r, times 1 if 1/C <= w <= C else 0: transitions whose behaviour policy is
  too far from the proximal one are left out (verl's `mask` mode, its lower bound 1/C by default).
  They count in the mean as zeros, so the loss's scale does not jump with the number rejected.

The loss of a minibatch is mean over its transitions of  weight * max(-A r, -A clip(r)).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rollout.outputs import Trajectory
from trainers_adapters.grpo.settings import OFF_POLICY_CORRECTIONS  # the corrections computed here
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.micro_batches import log_probs_without_grad

# weight version -> the adapter (a `LoraPolicy.lora_state()`) that ran the denoising steps of that version.
Behaviour = Mapping[int, Mapping[str, torch.Tensor]]


@dataclass
class ImportanceWeights:
    """The weights of a batch of transitions [B] (float32, no gradient) and what they did."""

    weights: torch.Tensor  # what multiplies each transition's clipped surrogate
    raw: torch.Tensor  # w = exp(p - b) before truncation or rejection
    corrected: torch.Tensor  # bool: truncated (tis) or rejected (rejection)


def importance_weights(
    proximal: torch.Tensor, behaviour: torch.Tensor, correction: str, cap: float
) -> ImportanceWeights:
    """The per-step weights of `correction` (see the module docstring) from the proximal and the
    behaviour log-probs [B]; with `none` every weight is 1."""
    raw = torch.exp(proximal.detach().float() - behaviour.detach().float())
    if correction == "none":
        return ImportanceWeights(torch.ones_like(raw), raw, torch.zeros_like(raw, dtype=torch.bool))
    if correction == "tis":
        return ImportanceWeights(raw.clamp(max=cap), raw, raw > cap)
    if correction == "rejection":
        kept = (raw >= 1.0 / cap) & (raw <= cap)
        return ImportanceWeights(kept.float(), raw, ~kept)
    raise ValueError(f"off_policy_correction must be one of {OFF_POLICY_CORRECTIONS}, got {correction!r}")


def check_behaviour_given(versions: set[int], behaviour: Behaviour) -> None:
    """Raise ValueError unless `behaviour` holds the adapter of every weight version in `versions`
    (those of the stale steps an update trains on)."""
    missing = sorted(versions - set(behaviour))
    if missing:
        raise ValueError(
            f"GRPO update refused: steps of weight version(s) {missing} are stale, but behaviour holds the adapters "
            f"of versions {sorted(behaviour)} only; pass the adapter that sampled each (or behaviour=None: no check)"
        )


def behaviour_log_ratio(
    policy: LoraPolicy, transitions: Sequence[tuple[Trajectory, int, int]], behaviour: Behaviour, size: int
) -> float:
    """Max |log ratio| of `transitions` (trajectory, step index, the weight version that ran the
    step), each re-scored without gradient by the adapter `behaviour[version]` held in `policy`
    (`LoraPolicy.holding`), in micro-batches of `size`, against the log-prob the engine logged."""
    worst = 0.0
    for version in sorted({version for _, _, version in transitions}):
        ran = [(trajectory, step) for trajectory, step, ran_with in transitions if ran_with == version]
        with policy.holding(behaviour[version]):
            found = log_probs_without_grad(policy, range(len(ran)), ran.__getitem__, size)
        rescored = torch.stack([found[number] for number in range(len(ran))]).cpu()
        logged = torch.stack([trajectory.log_probs[step] for trajectory, step in ran]).float()
        worst = max(worst, float((rescored - logged).abs().max()))
    return worst
