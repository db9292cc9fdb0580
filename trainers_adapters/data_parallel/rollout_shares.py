"""A step's rollout among the trainer ranks: each rank holds its share of the prompts' groups
whole, and a light copy of every other output, so that every rank computes the same advantages,
picks the same transitions and cuts the same minibatches as one rank would over the whole step,
and trains on its own share.

Two ways in: every rank sampled its own share (`gather_rollout`: colocated engines), or rank 0
sampled the whole step (`scatter_rollout`: one engine for the trainer ranks). A share is a
contiguous block of prompts (`TrainerRanks.share`), so the ranks' outputs in rank order are the
outputs of one rank's rollout, in the same order.
"""

from __future__ import annotations

import dataclasses

import torch

from rollout import RolloutOutput
from rollout.step_series import StepSeries
from trainers_adapters.data_parallel.trainer_ranks import TrainerRanks
from trainers_adapters.rewards.rewarded_rollout import RewardedRollout


def light_copy(output: RolloutOutput) -> RolloutOutput:
    """`output` without its tensors of the sample's size (image, video, latents, audio, the
    trajectory's latents, condition and records): what another rank needs to follow the update's
    bookkeeping. The trajectory keeps its per-step tensors (log-probs, sigmas, SDE mask) and which
    latents it kept (entries of size 0), so `scorable_steps` answers as on the whole one."""
    trajectory = output.trajectory
    if trajectory is not None:
        positions = trajectory.latents.positions
        kept = StepSeries(positions, [torch.empty(len(positions), 0)], trajectory.latents.length)
        trajectory = dataclasses.replace(trajectory, latents=kept, condition=None, records={})
    return dataclasses.replace(output, image=None, video=None, latents=None, audio=None, trajectory=trajectory)


def gather_rollout(ranks: TrainerRanks, share: RewardedRollout) -> RewardedRollout:
    """The step's rollout on every rank, from each rank's `share` (its `ranks.share` of the
    prompts, sampled and rewarded by its own engine): its own outputs whole, the others light.
    Timings are the slowest rank's."""
    if ranks.world_size == 1:
        return share
    light = dataclasses.replace(share, outputs=[light_copy(output) for output in share.outputs])
    shares = ranks.gather(light)
    start = sum(len(other.outputs) for other in shares[: ranks.rank])
    return _joined(shares, share, start)


def scatter_rollout(ranks: TrainerRanks, whole: RewardedRollout | None) -> RewardedRollout:
    """The step's rollout on every rank, from rank 0's `whole` rollout (the others pass None):
    each rank gets its share of the groups whole (`ranks.share` over the prompts), the others light."""
    if ranks.world_size == 1:
        return whole
    payloads = None
    if ranks.is_main:
        prompt_indices = list(dict.fromkeys(whole.group_ids.tolist()))  # in the outputs' order
        blocks = [TrainerRanks(r, ranks.world_size).share(len(prompt_indices)) for r in range(ranks.world_size)]
        light = dataclasses.replace(whole, outputs=[light_copy(output) for output in whole.outputs])
        payloads = []
        for block in blocks:
            mine = {prompt_indices[i] for i in block}
            held = [i for i, group in enumerate(whole.group_ids.tolist()) if group in mine]
            start = held[0] if held else 0
            payloads.append((light, start, [whole.outputs[i] for i in held]))
    light, start, outputs = ranks.scatter(payloads)
    joined = list(light.outputs)
    joined[start : start + len(outputs)] = outputs
    return dataclasses.replace(light, outputs=joined, held=range(start, start + len(outputs)))


def _joined(shares: list[RewardedRollout], own: RewardedRollout, start: int) -> RewardedRollout:
    outputs = [output for share in shares for output in share.outputs]
    outputs[start : start + len(own.outputs)] = own.outputs
    names = shares[0].reward_components
    return RewardedRollout(
        outputs=outputs,
        rewards=torch.cat([share.rewards for share in shares]),
        group_ids=torch.cat([share.group_ids for share in shares]),
        rollout_s=max(share.rollout_s for share in shares),
        reward_wait_s=max(share.reward_wait_s for share in shares),
        branch_steps=own.branch_steps,
        reward_components={name: torch.cat([share.reward_components[name] for share in shares]) for name in names},
        held=range(start, start + len(own.outputs)),
    )
