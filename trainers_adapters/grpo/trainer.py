"""One GRPO update from one rewarded rollout (Flow-GRPO, arXiv 2505.05470; DanceGRPO).

The rollout's SDE transitions (a random `timestep_fraction` of each trajectory's stochastic steps)
are credited with their sample's group advantage; in a tree rollout each transition belongs to the
tree node that ran it, is trained on once (not once per leaf below it) and gets that node's
advantage (BranchGRPO, see `trainers_adapters.grpo.tree`). They are shuffled and split into
`optimizer_steps` minibatches; each minibatch is re-scored by the policy in micro-batches, with
gradients, through the same sampler functions the engine used, and ends with one optimizer step.
Before the first optimizer step the policy is exactly the one that sampled, so the ratio of that
first minibatch must be 1: `log_ratio_before_update` reports it, and `log_ratio_by_step_max` /
`log_ratio_by_step_mean` break it down by denoising step, so a drift that only some steps show
(late ones, after a base update, in bfloat16) is visible. They cover the steps the first minibatch
holds: all of the trained ones with `optimizer_steps=1`, a random share of the transitions otherwise.
Samples an older policy made (asynchronous training) are held to the same contract when the update
is given the adapters that sampled them (`behaviour`): the first minibatch's stale transitions are
re-scored with the adapter of their step's version, and `log_ratio_before_update` covers them too.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from trainers_adapters.data_parallel.equal_passes import equal_passes
from trainers_adapters.data_parallel.trainer_ranks import TrainerRanks
from trainers_adapters.grpo.loss import grpo_policy_loss, kl_to_reference
from trainers_adapters.grpo.off_policy import (
    Behaviour,
    ImportanceWeights,
    behaviour_log_ratio,
    check_behaviour_given,
    importance_weights,
)
from trainers_adapters.grpo.settings import GRPOSettings
from trainers_adapters.grpo.tree import RolloutTree, build_tree, tree_advantages
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.micro_batches import log_probs_without_grad, micro_batches
from trainers_adapters.policy.optim import check_finite_loss, clip_and_step
from trainers_adapters.rewards.rewarded_rollout import RewardedRollout


@dataclass
class GRPOStepStats:
    loss: float  # mean over transitions of policy loss + kl_beta * kl
    policy_loss: float
    kl: float  # mean KL to the reference (0 when kl_beta is 0)
    # Max |log ratio| before this rollout's first optimizer step over the first minibatch's
    # transitions, each re-scored by the adapter that ran its step (the re-scoring contract): the
    # policy for its own version's, the `behaviour` adapter of their version for stale ones. None
    # when every one is stale and no behaviour adapters were given.
    log_ratio_before_update: float | None
    # Denoising step index -> max / mean |log ratio| (policy before the update against the logged
    # behaviour log-prob) over that step's transitions in the first minibatch, stale ones included:
    # the rollout/trainer mismatch, plus the policy's lag for samples of older versions.
    log_ratio_by_step_max: dict[int, float]
    log_ratio_by_step_mean: dict[int, float]
    ratio_mean: float
    clip_fraction: float
    grad_norm: float  # of the last optimizer step, before clipping
    advantage_abs_mean: float
    num_transitions: int
    # Versions between the policy and the step that made each transition (0 without policy_version).
    staleness_mean: float
    staleness_max: int
    # The importance weight w = exp(proximal - behaviour) before truncation (trainers_adapters.grpo.off_policy),
    # over every transition with a correction, over the first minibatch's with "none".
    importance_weight_mean: float
    importance_weight_std: float
    importance_weight_min: float
    importance_weight_max: float
    corrected_fraction: float  # of those, the share truncated (tis) or rejected (rejection)
    # Seconds spent re-scoring stale transitions with their behaviour adapters (0 without any): the
    # check's only cost, as the forward that trains re-scores the policy's own steps.
    behaviour_rescore_s: float


def grpo_step(
    policy: LoraPolicy,
    optimizer: torch.optim.Optimizer,
    rollout: RewardedRollout,
    settings: GRPOSettings,
    generator: torch.Generator,
    policy_version: int | None = None,
    behaviour: Behaviour | None = None,
    ranks: TrainerRanks | None = None,
) -> GRPOStepStats:
    """Run `settings.optimizer_steps` optimizer steps on `rollout`. The caller pushes the policy to
    the engine afterwards (the engine samples only with pushed weights). A rollout the policy's
    adapter did not sample (`SamplingParams(lora=policy.name)`) is refused before anything changes.

    `policy_version`: the engine weight version of the policy as it is now (pushed, or to be pushed
    under that number); a step that ran with another version is stale by the difference and weighed
    by `settings.off_policy_correction`. None: every step is the policy's own (a synchronous loop).

    `behaviour`: weight version -> the adapter (a `policy.lora_state()`, on the same base weights)
    that ran the steps of that version older than `policy_version` (the asynchronous loop keeps
    them: `recipes.async_rollouts`). Given, stale steps are held to the re-scoring contract with the
    adapter that sampled them, as the policy's own are with the policy, and a stale version it lacks
    is refused (ValueError) before anything changes; None leaves stale steps out of the check.

    `ranks`: the data-parallel trainer ranks (`trainers_adapters.data_parallel`); each runs this
    with the step's whole rollout as `rollout_shares` gives it, picks the same transitions and
    minibatches, trains on those of the samples it holds and sums the gradients over the ranks
    before each optimizer step; the statistics are the whole step's. None: one rank."""
    ranks = ranks if ranks is not None else TrainerRanks()
    _check_sampled_by_policy(policy, rollout)
    tree = build_tree(rollout.outputs, rollout.rewards, rollout.branch_steps, rollout.trajectories[0].num_steps)
    advantages = tree_advantages(tree, global_std=settings.global_std, clip_max=settings.adv_clip_max)
    trained = _trained_nodes(tree, advantages, settings.width_ratio)
    transitions = _pick_transitions(
        rollout, tree, advantages, trained, set(settings.prune_steps), settings.timestep_fraction, generator
    )
    if not transitions:
        raise ValueError(
            "the rollout has no SDE steps to train on; check sampling.sde_window, the sampler and grpo.prune_steps"
        )
    staleness = _staleness(rollout, transitions, policy_version)
    stale = {position for position, age in enumerate(staleness) if age > 0} if behaviour is not None else set()
    if stale:
        check_behaviour_given({_ran_with(rollout, transitions[position]) for position in stale}, behaviour)

    def held(positions: list[int]) -> list[int]:  # those of `positions` this rank trains on
        return [position for position in positions if rollout.holds(transitions[position][0])]

    order = torch.randperm(len(transitions), generator=generator).tolist()
    minibatches = [mb.tolist() for mb in torch.tensor_split(torch.tensor(order), settings.optimizer_steps)]
    minibatches = [minibatch for minibatch in minibatches if minibatch]
    later = [position for minibatch in minibatches[1:] for position in minibatch]
    decoupled = settings.off_policy_correction != "none"
    log_ratio_before_update, behaviour_rescore_s = None, 0.0
    stale_first = [position for position in held(minibatches[0]) if position in stale]
    if stale_first:  # before the forwards that train: `holding` must not swap between one and its backward
        started = time.perf_counter()
        transition_of = _transition_of(rollout, transitions)
        checked = [(*transition_of(p), _ran_with(rollout, transitions[p])) for p in stale_first]
        log_ratio_before_update = behaviour_log_ratio(policy, checked, behaviour, settings.micro_batch_size)
        behaviour_rescore_s = time.perf_counter() - started
    proximal = _proximal_log_probs(policy, rollout, transitions, held(later), settings) if decoupled and later else {}
    totals = dict.fromkeys(("loss", "policy_loss", "kl", "ratio_mean", "clip_fraction"), 0.0)
    first_steps, first_abs_log_ratios = [], []  # of the first minibatch: step index, |log ratio| per transition
    raw_weights, corrected = [], []
    grad_norm = 0.0
    filler = held(list(range(len(transitions))))[:1]  # a sharded policy's zero-weight pass (equal_passes)
    for number, minibatch in enumerate(minibatches):
        optimizer.zero_grad(set_to_none=True)
        chunks = micro_batches(held(minibatch), _trajectory_of(rollout, transitions), settings.micro_batch_size)
        for chunk, counts in equal_passes(ranks, chunks, filler, policy.sharded):
            chosen = [transitions[position] for position in chunk]
            given = torch.stack([proximal[position] for position in chunk]) if number > 0 and decoupled else None
            loss, parts, scored = _chunk_loss(policy, rollout, chosen, settings, given)
            check_finite_loss(parts["loss"], optimizer, _describe(chosen, parts))
            (loss * (len(chunk) / len(minibatch) if counts else 0.0)).backward()
            if not counts:
                continue
            for key in totals:
                totals[key] += parts[key] * len(chunk)
            if number == 0 or decoupled:
                raw_weights.append(scored.weights.raw)
                corrected.append(scored.weights.corrected)
            if number == 0:
                fresh = torch.tensor([staleness[position] == 0 for position in chunk])
                if fresh.any():
                    worst = float(scored.abs_log_ratio[fresh].max())
                    log_ratio_before_update = max(log_ratio_before_update or 0.0, worst)
                first_steps += [step for _, step, _ in chosen]
                first_abs_log_ratios.append(scored.abs_log_ratio)
        if number == 0:
            log_ratio_before_update = _worst_over_ranks(ranks, log_ratio_before_update)
            any_stale_first = ranks.max(float(bool(stale_first))) > 0
        if number == 0 and log_ratio_before_update is not None:
            limit = settings.max_log_ratio_before_update
            _check_ratio(log_ratio_before_update, limit, optimizer, rollout, stale=any_stale_first)
        policy.sum_gradients(ranks)
        grad_norm = clip_and_step(policy.parameters(), optimizer, settings.max_grad_norm)
    optimizer.zero_grad(set_to_none=True)
    count = len(transitions)
    first = ranks.gather((first_steps, _cat(first_abs_log_ratios)))
    first_steps = [step for steps, _ in first for step in steps]
    by_step_max, by_step_mean = _by_step(torch.tensor(first_steps), torch.cat([ratios for _, ratios in first]))
    raw = torch.cat(ranks.gather(_cat(raw_weights)))
    corrected = ranks.gather(_cat(corrected, torch.bool))
    return GRPOStepStats(
        **{key: ranks.sum(value) / count for key, value in totals.items()},
        log_ratio_before_update=log_ratio_before_update,
        log_ratio_by_step_max=by_step_max,
        log_ratio_by_step_mean=by_step_mean,
        grad_norm=grad_norm,
        advantage_abs_mean=float(torch.tensor([advantage for _, _, advantage in transitions]).abs().mean()),
        num_transitions=count,
        staleness_mean=sum(staleness) / count,
        staleness_max=max(staleness),
        importance_weight_mean=float(raw.mean()),
        importance_weight_std=float(raw.std(unbiased=False)),
        importance_weight_min=float(raw.min()),
        importance_weight_max=float(raw.max()),
        corrected_fraction=float(torch.cat(corrected).float().mean()),
        behaviour_rescore_s=ranks.max(behaviour_rescore_s),
    )


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`tensors` [B_i] joined; empty on a rank that held none of them."""
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)


def _worst_over_ranks(ranks: TrainerRanks, log_ratio: float | None) -> float | None:
    """The largest of the ranks' `log_ratio`s; None where no rank re-scored any (-1 stands for it)."""
    worst = ranks.max(-1.0 if log_ratio is None else log_ratio)
    return None if worst < 0 else worst


def _ran_with(rollout: RewardedRollout, transition: tuple[int, int, float]) -> int:
    """The weight version that ran the step of `transition`."""
    index, step, _ = transition
    return rollout.outputs[index].step_weight_versions[step]


def _staleness(rollout: RewardedRollout, transitions: list[tuple[int, int, float]], version: int | None) -> list[int]:
    """Per transition: `version` minus the version its step ran with (0 without `version`)."""
    if version is None:
        return [0] * len(transitions)
    stale = []
    for transition in transitions:
        index, step, _ = transition
        ran_with = _ran_with(rollout, transition)
        if ran_with > version:
            raise ValueError(
                f"sample {rollout.outputs[index].request_id} step {step} ran with weight version {ran_with}, newer "
                f"than the policy's {version}: the engine holds weights this policy has not seen"
            )
        stale.append(version - ran_with)
    return stale


def _trajectory_of(rollout: RewardedRollout, transitions: list[tuple[int, int, float]]):
    """position in `transitions` -> the trajectory of its sample (what micro-batches group by)."""
    return lambda position: rollout.outputs[transitions[position][0]].trajectory


def _transition_of(rollout: RewardedRollout, transitions: list[tuple[int, int, float]]):
    """position in `transitions` -> (its sample's trajectory, its step index): what a re-score takes."""
    return lambda position: (rollout.outputs[transitions[position][0]].trajectory, transitions[position][1])


def _proximal_log_probs(
    policy: LoraPolicy,
    rollout: RewardedRollout,
    transitions: list[tuple[int, int, float]],
    positions: list[int],
    settings: GRPOSettings,
) -> dict[int, torch.Tensor]:
    """The policy's log-prob of each transition at `positions`, before any optimizer step, without
    gradient: the proximal policy of the minibatches after the first (`trainers_adapters.grpo.off_policy`)."""
    return log_probs_without_grad(policy, positions, _transition_of(rollout, transitions), settings.micro_batch_size)


def _by_step(steps: torch.Tensor, abs_log_ratio: torch.Tensor) -> tuple[dict[int, float], dict[int, float]]:
    """Max and mean of `abs_log_ratio` [B] over the transitions of each step index in `steps` [B]."""
    by_max, by_mean = {}, {}
    for step in torch.unique(steps).tolist():  # sorted
        values = abs_log_ratio[steps == step]
        by_max[step], by_mean[step] = float(values.max()), float(values.mean())
    return by_max, by_mean


class PolicyDriftError(RuntimeError):
    """The policy does not re-score the rollout as the engine sampled it (ratio far from 1 before
    any update): training on would push it in the wrong direction."""


def _check_sampled_by_policy(policy: LoraPolicy, rollout: RewardedRollout) -> None:
    """The ratio compares the policy with the adapter that sampled: samples of the base model or of
    another adapter would train one step (the fresh LoRA is the base) and then fail the drift check
    for a reason it does not name."""
    others = sorted({output.lora for output in rollout.outputs} - {policy.name}, key=str)
    if others:
        raise ValueError(
            f"GRPO update refused: the rollout's samples come from adapter(s) {others} (None: the base model), "
            f"not the policy's {policy.name!r}; generate with SamplingParams(lora={policy.name!r}) after "
            "policy.push(engine)"
        )


def _check_ratio(log_ratio: float, tolerance: float | None, optimizer, rollout: RewardedRollout, stale: bool) -> None:
    """The re-scoring contract's guard; `stale`: some steps were re-scored by their behaviour adapters."""
    if tolerance is None or log_ratio <= tolerance:
        return
    optimizer.zero_grad(set_to_none=True)
    scales = sorted({t.lora_scale for t in rollout.trajectories}, key=str)
    versions = sorted({output.weight_version for output in rollout.outputs})
    scorer, cause = "the policy", ""
    if stale:
        scorer = "the policy (its own steps) and the behaviour adapters (older steps, each by its version's)"
        cause = "a behaviour adapter is not the one the engine sampled its version with; "
    raise PolicyDriftError(
        f"before any update the rollout re-scores under {scorer} with max |log ratio| {log_ratio:.2e} > "
        f"{tolerance:g}: that is not what sampled. The rollout was sampled at weight version(s) {versions} "
        f"with lora_scale {scales} (re-scored at the same scale). Likely causes: {cause}the adapter was not "
        "pushed after the last update (policy.push(engine); compare the version it returns with the outputs' "
        "weight_version); the engine's base weights were updated (update_weights) and the policy's were not "
        "(policy.load_base_weights with the same tensors), or the engine loaded another model folder "
        "(policy.check_same_base(engine) compares weights_checksum); or the engine and the policy differ in "
        "dtype or device. GRPOSettings(max_log_ratio_before_update=None) only reports it."
    )


def _trained_nodes(tree: RolloutTree, advantages: torch.Tensor, width_ratio: float) -> list[int]:
    """The nodes whose steps are trained on: every inner node, and the leaves width pruning keeps
    (the best and the worst by advantage; at least one of each)."""
    leaf_depth = len(tree.branch_steps)
    inner = [i for i, node in enumerate(tree.nodes) if node.depth < leaf_depth]
    leaves = [i for i, node in enumerate(tree.nodes) if node.depth == leaf_depth]
    leaves.sort(key=lambda i: -float(advantages[i]))  # best first
    keep = max(2, round(width_ratio * len(leaves)))
    if keep >= len(leaves):
        return inner + leaves
    best = keep // 2
    return inner + leaves[:best] + leaves[len(leaves) - (keep - best) :]


def _pick_transitions(
    rollout: RewardedRollout,
    tree: RolloutTree,
    advantages: torch.Tensor,
    trained: list[int],
    pruned_steps: set[int],
    fraction: float,
    generator: torch.Generator,
) -> list[tuple[int, int, float]]:
    """(sample index, step index, advantage): a random `fraction` (at least one) of the SDE steps
    each trained node ran (each sample's, without branching), outside `pruned_steps`, read from
    the first leaf below it."""
    transitions = []
    for number in sorted(trained):
        node, advantage = tree.nodes[number], float(advantages[number])
        index = node.leaves[0]
        scorable = set(rollout.trajectories[index].scorable_steps.tolist()) - pruned_steps
        steps = torch.tensor([step for step in node.steps if step in scorable], dtype=torch.int64)
        if len(steps) == 0:
            continue
        keep = max(1, round(fraction * len(steps)))
        chosen = steps[torch.randperm(len(steps), generator=generator)[:keep]]
        transitions += [(index, int(step), advantage) for step in chosen]
    return transitions


@dataclass
class _Scored:
    """What a trained chunk reports besides its loss, per transition [B] (float32, no gradient)."""

    abs_log_ratio: torch.Tensor  # |log-prob now - behaviour log-prob|
    weights: ImportanceWeights


def _chunk_loss(
    policy: LoraPolicy,
    rollout: RewardedRollout,
    chunk: list[tuple[int, int, float]],
    settings: GRPOSettings,
    proximal: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float], _Scored]:
    """The chunk's loss (to backpropagate), its statistics, and its per-transition report.
    `proximal` [B]: the policy's log-probs before the update's first optimizer step (the later
    minibatches of a decoupled correction); None: the log-probs this forward computes are those."""
    trajectories = [rollout.outputs[index].trajectory for index, _, _ in chunk]
    steps = [step for _, step, _ in chunk]
    scored = policy.score(trajectories, steps)
    device = scored.log_prob.device
    behaviour = torch.stack([t.log_probs[step] for t, step in zip(trajectories, steps, strict=True)]).to(device)
    proximal = scored.log_prob.detach() if proximal is None else proximal.to(device)
    weights = importance_weights(proximal, behaviour, settings.off_policy_correction, settings.importance_cap)
    chunk_advantages = torch.tensor([advantage for _, _, advantage in chunk], device=device)
    if settings.off_policy_correction == "none":
        policy_loss, stats = grpo_policy_loss(scored.log_prob, behaviour, chunk_advantages, settings.clip_range)
    else:
        policy_loss, stats = grpo_policy_loss(
            scored.log_prob, proximal, chunk_advantages, settings.clip_range, weights.weights
        )
    kl = torch.zeros((), device=policy_loss.device)
    if settings.kl_beta > 0:
        with policy.reference():
            reference = policy.score(trajectories, steps)
        kl = kl_to_reference(scored, reference.mean, settings.kl_form).mean()
    loss = policy_loss + settings.kl_beta * kl
    parts = {
        "loss": loss.item(),
        "policy_loss": policy_loss.item(),
        "kl": kl.item(),
        "ratio_mean": stats.ratio_mean,
        "clip_fraction": stats.clip_fraction,
    }
    abs_log_ratio = (scored.log_prob.detach() - behaviour).abs().float().cpu()
    cpu_weights = ImportanceWeights(*(tensor.cpu() for tensor in dataclasses.astuple(weights)))
    return loss, parts, _Scored(abs_log_ratio, cpu_weights)


def _describe(chunk: list[tuple[int, int, float]], parts: dict[str, float]) -> str:
    pairs = [(index, step) for index, step, _ in chunk]
    return (
        f"GRPO micro-batch (policy loss {parts['policy_loss']}, kl {parts['kl']}) over (sample, step) "
        f"{pairs[:6]}{' ...' if len(pairs) > 6 else ''}"
    )
