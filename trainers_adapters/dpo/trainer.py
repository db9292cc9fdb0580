"""One online Diffusion-DPO update from one rewarded rollout (Wallace et al., arXiv 2311.12908).

Each group's best and worst sample form a pair. Both final latents x0 are noised with one shared
sigma and one shared noise (the sigma drawn from the rollout's own schedule, so training sees the
noise levels sampling visits), each pair's drawn from its own seed so that data-parallel ranks draw
what one rank would; the policy's and the frozen reference's flow-matching errors on the
pair give the DPO loss. One optimizer step per rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers_adapters.data_parallel.equal_passes import equal_passes
from trainers_adapters.data_parallel.trainer_ranks import TrainerRanks
from trainers_adapters.dpo.loss import dpo_loss, flow_matching_error, preference_pairs
from trainers_adapters.dpo.settings import DPOSettings
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.micro_batches import micro_batches
from trainers_adapters.policy.optim import check_finite_loss, clip_and_step
from trainers_adapters.rewards.rewarded_rollout import RewardedRollout


@dataclass
class DPOStepStats:
    loss: float
    accuracy: float  # share of pairs where the policy favours the winner more than the reference does
    num_pairs: int  # groups whose rewards were not all equal
    reward_margin: float  # mean reward of winners minus losers
    grad_norm: float


def dpo_step(
    policy: LoraPolicy,
    optimizer: torch.optim.Optimizer,
    rollout: RewardedRollout,
    settings: DPOSettings,
    generator: torch.Generator,
    ranks: TrainerRanks | None = None,
) -> DPOStepStats:
    """One optimizer step on the rollout's preference pairs (none when every group is a tie).
    `ranks`: the data-parallel trainer ranks, each with the whole step's rollout as
    `trainers_adapters.data_parallel.rollout_shares` gives it; each trains on the pairs of the
    groups it holds and the gradients are summed over the ranks. None: one rank."""
    ranks = ranks if ranks is not None else TrainerRanks()
    pairs = preference_pairs(rollout.rewards, rollout.group_ids)
    if not pairs:
        return DPOStepStats(loss=0.0, accuracy=0.0, num_pairs=0, reward_margin=0.0, grad_norm=0.0)
    seeds = torch.randint(2**62, (len(pairs),), generator=generator).tolist()  # one per pair, every rank alike
    held = [(pair, seed) for pair, seed in zip(pairs, seeds, strict=True) if rollout.holds(pair[0])]
    optimizer.zero_grad(set_to_none=True)
    total_loss = correct = 0.0
    # A pair shares its group's settings; pairs of groups of other sizes go in other forwards.
    chunks = micro_batches(held, lambda item: rollout.outputs[item[0][0]].trajectory, settings.micro_batch_size)
    mine = rollout.held.start if rollout.held is not None else 0  # a sample of this rank's, for a filler pass
    for chunk, counts in equal_passes(ranks, chunks, [((mine, mine), 0)], policy.sharded):
        loss, favoured = _chunk_loss(policy, rollout, chunk, settings.beta)
        value = loss.item()
        check_finite_loss(value, optimizer, f"DPO pairs (winner, loser) {[pair for pair, _ in chunk[:6]]}")
        (loss * (len(chunk) / len(pairs) if counts else 0.0)).backward()
        if counts:
            total_loss += value * len(chunk)
            correct += favoured
    policy.sum_gradients(ranks)
    grad_norm = clip_and_step(policy.parameters(), optimizer, settings.max_grad_norm)
    optimizer.zero_grad(set_to_none=True)
    total_loss, correct = ranks.sum(total_loss), ranks.sum(correct)
    winners = torch.tensor([winner for winner, _ in pairs])
    losers = torch.tensor([loser for _, loser in pairs])
    return DPOStepStats(
        loss=total_loss / len(pairs),
        accuracy=correct / len(pairs),
        num_pairs=len(pairs),
        reward_margin=float((rollout.rewards[winners] - rollout.rewards[losers]).mean()),
        grad_norm=grad_norm,
    )


def _chunk_loss(
    policy: LoraPolicy,
    rollout: RewardedRollout,
    chunk: list[tuple[tuple[int, int], int]],
    beta: float,
) -> tuple[torch.Tensor, int]:
    """DPO loss of `chunk` ((winner, loser), seed) and how many of its pairs the policy favours
    over the reference."""
    trajectories = rollout.trajectories
    pairs = [pair for pair, _ in chunk]
    order = [winner for winner, _ in pairs] + [loser for _, loser in pairs]  # winners first, then losers
    device = policy.adapter.device
    x0 = torch.stack([trajectories[i].latents[-1] for i in order]).to(device)
    ones = [1] * (x0.ndim - 1)  # latents of any rank
    # One sigma and one noise per pair, shared by its winner and loser, drawn from the pair's seed.
    sigmas, noise = [], []
    for (winner, _), seed in chunk:
        pair_generator = torch.Generator().manual_seed(seed)
        schedule = trajectories[winner].sigmas[:-1]
        sigmas.append(schedule[torch.randint(len(schedule), (), generator=pair_generator)])
        noise.append(torch.randn(trajectories[winner].latents[-1].shape, generator=pair_generator))
    sigmas = torch.stack(sigmas).repeat(2)
    noise = torch.stack(noise).repeat(2, *ones).to(device)
    sigmas = sigmas.to(device)
    noisy = (1 - sigmas.view(-1, *ones)) * x0 + sigmas.view(-1, *ones) * noise
    ordered = [trajectories[i] for i in order]
    errors = flow_matching_error(policy.predict_velocity(noisy, sigmas, ordered), x0, noise)
    with policy.reference():
        reference = flow_matching_error(policy.predict_velocity(noisy, sigmas, ordered), x0, noise)
    err_w, err_l = errors.chunk(2)
    ref_w, ref_l = reference.chunk(2)
    favoured = int(((err_w - err_l) < (ref_w - ref_l)).sum())
    return dpo_loss(err_w, err_l, ref_w, ref_l, beta), favoured
