"""One GRPO update from one rewarded rollout (Flow-GRPO, arXiv 2505.05470; DanceGRPO).

The rollout's SDE transitions (a random `timestep_fraction` of each trajectory's stochastic steps)
are credited with their sample's group advantage; in a tree rollout each transition belongs to the
tree node that ran it, is trained on once (not once per leaf below it) and gets that node's
advantage (BranchGRPO, see `trainers_adapters.tree`). They are shuffled and split into
`optimizer_steps` minibatches; each minibatch is re-scored by the policy in micro-batches, with
gradients, through the same sampler functions the engine used, and ends with one optimizer step.
Before the first optimizer step the policy is exactly the one that sampled, so the ratio of that
first minibatch must be 1: `log_ratio_before_update` reports it, and `log_ratio_by_step_max` /
`log_ratio_by_step_mean` break it down by denoising step, so a drift that only some steps show
(late ones, after a base update, in bfloat16) is visible. They cover the steps the first minibatch
holds: all of the trained ones with `optimizer_steps=1`, a random share of the transitions otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers_adapters.grpo import grpo_policy_loss, kl_to_reference
from trainers_adapters.grpo_settings import GRPOSettings
from trainers_adapters.lora_policy import LoraPolicy
from trainers_adapters.micro_batches import micro_batches
from trainers_adapters.optim import check_finite_loss, clip_and_step
from trainers_adapters.rewards.rewarded_rollout import RewardedRollout
from trainers_adapters.tree import RolloutTree, build_tree, tree_advantages


@dataclass
class GRPOStepStats:
    loss: float  # mean over transitions of policy loss + kl_beta * kl
    policy_loss: float
    kl: float  # mean KL to the reference (0 when kl_beta is 0)
    log_ratio_before_update: float  # max |log ratio| before this rollout's first optimizer step
    # Denoising step index -> max / mean |log ratio| over that step's transitions in the first
    # minibatch (before any optimizer step); the steps that minibatch holds, in increasing order.
    log_ratio_by_step_max: dict[int, float]
    log_ratio_by_step_mean: dict[int, float]
    ratio_mean: float
    clip_fraction: float
    grad_norm: float  # of the last optimizer step, before clipping
    advantage_abs_mean: float
    num_transitions: int


def grpo_step(
    policy: LoraPolicy,
    optimizer: torch.optim.Optimizer,
    rollout: RewardedRollout,
    settings: GRPOSettings,
    generator: torch.Generator,
) -> GRPOStepStats:
    """Run `settings.optimizer_steps` optimizer steps on `rollout`. The caller pushes the policy to
    the engine afterwards (the engine samples only with pushed weights). A rollout the policy's
    adapter did not sample (`SamplingParams(lora=policy.name)`) is refused before anything changes."""
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
    order = torch.randperm(len(transitions), generator=generator).tolist()
    minibatches = [mb.tolist() for mb in torch.tensor_split(torch.tensor(order), settings.optimizer_steps)]
    totals = dict.fromkeys(("loss", "policy_loss", "kl", "ratio_mean", "clip_fraction"), 0.0)
    log_ratio_before_update = 0.0
    first_steps, first_abs_log_ratios = [], []  # of the first minibatch: step index, |log ratio| per transition
    grad_norm = 0.0
    for number, minibatch in enumerate(m for m in minibatches if m):
        optimizer.zero_grad(set_to_none=True)
        chosen = [transitions[i] for i in minibatch]
        for chunk in micro_batches(chosen, lambda t: rollout.outputs[t[0]].trajectory, settings.micro_batch_size):
            loss, parts, abs_log_ratio = _chunk_loss(policy, rollout, chunk, settings)
            check_finite_loss(parts["loss"], optimizer, _describe(chunk, parts))
            (loss * len(chunk) / len(minibatch)).backward()
            for key in totals:
                totals[key] += parts[key] * len(chunk)
            if number == 0:
                log_ratio_before_update = max(log_ratio_before_update, float(abs_log_ratio.max()))
                first_steps += [step for _, step, _ in chunk]
                first_abs_log_ratios.append(abs_log_ratio.cpu())
        if number == 0:
            _check_ratio(log_ratio_before_update, settings.max_log_ratio_before_update, optimizer, rollout)
        grad_norm = clip_and_step(policy.parameters(), optimizer, settings.max_grad_norm)
    optimizer.zero_grad(set_to_none=True)
    count = len(transitions)
    by_step_max, by_step_mean = _by_step(torch.tensor(first_steps), torch.cat(first_abs_log_ratios))
    return GRPOStepStats(
        **{key: value / count for key, value in totals.items()},
        log_ratio_before_update=log_ratio_before_update,
        log_ratio_by_step_max=by_step_max,
        log_ratio_by_step_mean=by_step_mean,
        grad_norm=grad_norm,
        advantage_abs_mean=float(torch.tensor([advantage for _, _, advantage in transitions]).abs().mean()),
        num_transitions=count,
    )


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


def _check_ratio(
    log_ratio: float, tolerance: float | None, optimizer: torch.optim.Optimizer, rollout: RewardedRollout
) -> None:
    if tolerance is None or log_ratio <= tolerance:
        return
    optimizer.zero_grad(set_to_none=True)
    scales = sorted({t.lora_scale for t in rollout.trajectories}, key=str)
    versions = sorted({output.weight_version for output in rollout.outputs})
    raise PolicyDriftError(
        f"before any update the policy re-scores the rollout with max |log ratio| {log_ratio:.2e} > "
        f"{tolerance:g}: it is not the policy that sampled. The rollout was sampled at weight version(s) "
        f"{versions} with lora_scale {scales} (re-scored at the same scale). Likely causes: the adapter was not "
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


def _chunk_loss(
    policy: LoraPolicy,
    rollout: RewardedRollout,
    chunk: list[tuple[int, int, float]],
    settings: GRPOSettings,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The chunk's loss (to backpropagate), its statistics, and the |log ratio| of each transition [B]
    (float32, no gradient)."""
    trajectories = [rollout.outputs[index].trajectory for index, _, _ in chunk]
    steps = [step for _, step, _ in chunk]
    scored = policy.score(trajectories, steps)
    device = scored.log_prob.device
    old = torch.stack([t.log_probs[step] for t, step in zip(trajectories, steps, strict=True)]).to(device)
    chunk_advantages = torch.tensor([advantage for _, _, advantage in chunk], device=device)
    policy_loss, stats = grpo_policy_loss(scored.log_prob, old, chunk_advantages, settings.clip_range)
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
    return loss, parts, (scored.log_prob.detach() - old).abs()


def _describe(chunk: list[tuple[int, int, float]], parts: dict[str, float]) -> str:
    pairs = [(index, step) for index, step, _ in chunk]
    return (
        f"GRPO micro-batch (policy loss {parts['policy_loss']}, kl {parts['kl']}) over (sample, step) "
        f"{pairs[:6]}{' ...' if len(pairs) > 6 else ''}"
    )
