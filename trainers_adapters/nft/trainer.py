"""One DiffusionNFT update from one rewarded rollout of the old policy (Zheng et al., arXiv
2509.16117; the loss in `trainers_adapters.nft.loss`, the old policy in `trainers_adapters.policy.old_policy`).

The rollout is the old adapter's deterministic ODE samples without CFG; only their clean latents
x0, their prompts and their rewards are used (no log-probs, so any solver would do). As the
authors' code does: advantages are each prompt's reward minus its group's mean over the std of all
the step's rewards, mapped to r in [0, 1]; each sample is trained on a random `timestep_fraction`
of its own sampling schedule's noise levels (9 of 10), each with fresh noise (drawn from a seed of
its own, so that data-parallel ranks draw what one rank would); the samples are
shuffled and split into `optimizer_steps` minibatches, one optimizer step each; then the old
adapter follows the current one by EMA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers_adapters.advantages import group_advantages
from trainers_adapters.data_parallel.trainer_ranks import TrainerRanks
from trainers_adapters.nft.loss import nft_loss, optimality_probability
from trainers_adapters.nft.settings import NFTSettings
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.old_policy import OldPolicy
from trainers_adapters.policy.optim import check_finite_loss, clip_and_step
from trainers_adapters.rewards.rewarded_rollout import RewardedRollout


@dataclass
class NFTStepStats:
    loss: float  # mean over (sample, noise level) pairs of policy loss + kl_beta * kl
    policy_loss: float
    kl: float  # mean((v - v_ref)^2) (0 when kl_beta is 0)
    old_deviation: float  # mean((v - v_old)^2): how far the current policy is from the one that sampled
    r_mean: float  # mean optimality probability
    advantage_abs_mean: float
    grad_norm: float  # of the last optimizer step, before clipping
    old_decay: float  # the EMA decay the old policy followed the current one with after this update
    old_optimizer_steps: int  # optimizer steps the old policy's schedule has counted
    num_pairs: int


def nft_step(
    policy: LoraPolicy,
    old: OldPolicy,
    optimizer: torch.optim.Optimizer,
    rollout: RewardedRollout,
    settings: NFTSettings,
    generator: torch.Generator,
    ranks: TrainerRanks | None = None,
) -> NFTStepStats:
    """Run `settings.optimizer_steps` optimizer steps on `rollout`, then move the old adapter
    towards the current one. The caller pushes both to the engine afterwards. `ranks`: the
    data-parallel trainer ranks, each with the whole step's rollout as
    `trainers_adapters.data_parallel.rollout_shares` gives it; each trains on the samples it
    holds and the gradients are summed over the ranks. None: one rank."""
    ranks = ranks if ranks is not None else TrainerRanks()
    _check_rollout(policy, old, rollout)
    advantages = group_advantages(
        rollout.rewards, rollout.group_ids, global_std=settings.global_std, clip_max=settings.adv_clip_max
    )
    r = optimality_probability(advantages, settings.adv_clip_max)
    order = torch.randperm(len(rollout.outputs), generator=generator)
    pairs = {int(i): _noise_levels(rollout.trajectories[int(i)], settings.timestep_fraction, generator) for i in order}
    totals = dict.fromkeys(("loss", "policy_loss", "kl", "old_deviation"), 0.0)
    grad_norm, count, steps = 0.0, 0, 0
    for minibatch in torch.tensor_split(order, settings.optimizer_steps):
        chunk_pairs = [(int(i), level) for i in minibatch for level in pairs[int(i)]]
        if not chunk_pairs:
            continue
        seeds = torch.randint(2**62, (len(chunk_pairs),), generator=generator).tolist()  # every rank alike
        held = [(*pair, seed) for pair, seed in zip(chunk_pairs, seeds, strict=True) if rollout.holds(pair[0])]
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(held), settings.micro_batch_size):
            chunk = held[start : start + settings.micro_batch_size]
            loss, parts = _chunk_loss(policy, old, rollout, chunk, r, settings)
            described = [(i, level) for i, level, _ in chunk[:6]]
            check_finite_loss(parts["loss"], optimizer, f"DiffusionNFT (sample, noise level index) pairs {described}")
            (loss * len(chunk) / len(chunk_pairs)).backward()
            for key in totals:
                totals[key] += parts[key] * len(chunk)
        policy.sum_gradients(ranks)
        grad_norm = clip_and_step(policy.parameters(), optimizer, settings.max_grad_norm)
        count += len(chunk_pairs)
        steps += 1
    optimizer.zero_grad(set_to_none=True)
    decay = old.step(steps, settings.decay_schedule())
    return NFTStepStats(
        **{key: ranks.sum(value) / count for key, value in totals.items()},
        r_mean=float(r.mean()),
        advantage_abs_mean=float(advantages.abs().mean()),
        grad_norm=grad_norm,
        old_decay=decay,
        old_optimizer_steps=old.optimizer_steps,
        num_pairs=count,
    )


def _noise_levels(trajectory, fraction: float, generator: torch.Generator) -> list[int]:
    """Indices into the trajectory's sigmas[:-1] (its sampling schedule, sigma > 0): a random
    int(T * fraction) of them (at least one), as the authors' code draws per sample."""
    steps = trajectory.sigmas.shape[0] - 1
    keep = max(1, int(steps * fraction))
    return torch.randperm(steps, generator=generator)[:keep].tolist()


def _chunk_loss(
    policy: LoraPolicy,
    old: OldPolicy,
    rollout: RewardedRollout,
    chunk: list[tuple[int, int, int]],
    r: torch.Tensor,
    settings: NFTSettings,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of `chunk` (sample, noise level index, the seed of its noise) and its statistics."""
    trajectories = [rollout.trajectories[i] for i, _, _ in chunk]
    device = policy.adapter.device
    x0 = torch.stack([t.latents[-1] for t in trajectories]).to(device)
    t = torch.stack([traj.sigmas[level] for traj, (_, level, _) in zip(trajectories, chunk, strict=True)]).to(device)
    noise = [torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(seed)) for _, _, seed in chunk]
    noise = torch.stack(noise).to(device)
    t_b = t.view(-1, *([1] * (x0.ndim - 1)))
    x_t = (1 - t_b) * x0 + t_b * noise
    v_theta = policy.predict_velocity(x_t, t, trajectories)
    with old.active():
        v_old = policy.predict_velocity(x_t, t, trajectories)
    dims = tuple(range(1, x0.ndim))
    policy_loss = nft_loss(
        v_theta, v_old, x_t, x0, t, r[[i for i, _, _ in chunk]].to(device), settings.beta, settings.adv_clip_max
    ).mean()
    kl = torch.zeros((), device=device)
    if settings.kl_beta > 0:
        with policy.reference():
            v_ref = policy.predict_velocity(x_t, t, trajectories)
        kl = ((v_theta - v_ref) ** 2).mean(dim=dims).mean()
    loss = policy_loss + settings.kl_beta * kl
    parts = {
        "loss": loss.item(),
        "policy_loss": policy_loss.item(),
        "kl": kl.item(),
        "old_deviation": float(((v_theta.detach() - v_old) ** 2).mean()),
    }
    return loss, parts


def _check_rollout(policy: LoraPolicy, old: OldPolicy, rollout: RewardedRollout) -> None:
    """DiffusionNFT trains on the old policy's own CFG-free ODE samples; refuse any other rollout
    before anything changes."""
    problems = []
    adapters = {output.lora for output in rollout.outputs} - {old.name}
    if adapters:
        problems.append(
            f"samples from adapter(s) {sorted(adapters, key=str)}, not the old policy's {old.name!r}: "
            f"generate with SamplingParams(lora={old.name!r}) after old.push(engine)"
        )
    samplers = {t.sampler for t in rollout.trajectories} - {"ode"}
    if samplers:
        problems.append(f"sampler(s) {sorted(samplers)}: DiffusionNFT's rollouts are deterministic; use sampler='ode'")
    spec = policy.adapter.spec
    if spec.cfg_field is not None:
        scales = {getattr(t, spec.cfg_field) for t in rollout.trajectories}
        guided = sorted(s for s in scales if s is not None and s > spec.cfg_threshold)
        if guided:
            problems.append(
                f"{spec.cfg_field} {guided} turns on classifier-free guidance, but the loss trains the conditional "
                f"velocity alone (DiffusionNFT samples without CFG); set {spec.cfg_field}={spec.cfg_threshold:g}"
            )
    if problems:
        raise ValueError("DiffusionNFT update refused: " + "; ".join(problems))
