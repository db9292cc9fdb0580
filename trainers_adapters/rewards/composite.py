"""Weighted sums of named rewards, and rewards that score a whole group at once.

A reward is pointwise unless it says otherwise: each sample's score depends only on that sample
and its prompt, so callers may score any batch of samples in one call. A `GroupwiseReward` (a
pairwise or listwise judge, e.g. Pref-GRPO's) scores the samples of one prompt against each other:
it is always called with exactly one whole group, in sample order (then branch path), never with a
part of a group or with two groups together. `CompositeReward` scores each component (a pointwise
one once for the whole batch, a groupwise one once per group), checks every component's output
(`checks`), and sums them with their weights; the components' own scores travel with the
total, so a run logs each one. A component that has components of its own (a `RewardWithComponents`:
a composite, a reward service's composite behind `RemoteReward`) passes them on too, each named
"<component>/<its component>" (logged as reward/judge/clip_score), outside the sum.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainers_adapters.rewards.builtin import Reward
from trainers_adapters.rewards.checks import RewardError, checked_scores
from trainers_adapters.rewards.models.clip import ClipRewardModel


class GroupwiseReward:
    """Base of a reward that scores the samples of one prompt together: `__call__(images, prompts,
    metadata) -> [n]` receives all n samples of one group (images [n, 3, H, W] or videos, the same
    prompt n times, metadata with prompt_index and sample_index). Subclass it, or wrap a function
    with `groupwise`."""

    name = "groupwise"

    def __call__(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        raise NotImplementedError


class _GroupwiseFunction(GroupwiseReward):
    def __init__(self, function: Callable):
        self.function = function
        self.name = function.__name__
        functools.update_wrapper(self, function)

    def __call__(self, images, prompts, metadata):
        return self.function(images, prompts, metadata)


def groupwise(function: Callable) -> GroupwiseReward:
    """Declare the reward function `function` groupwise (as a decorator): it gets whole groups."""
    return _GroupwiseFunction(function)


def reward_name(reward: Reward) -> str:
    """What errors and metrics call a reward given as a bare callable."""
    if isinstance(reward, types.FunctionType):
        return reward.__name__
    if isinstance(reward, ClipRewardModel | GroupwiseReward):
        return reward.name
    return type(reward).__name__  # an instance of a user's reward class


class RewardWithComponents:
    """Base of a reward that gives the scores of its own components with its total:
    `score(images, prompts, metadata) -> RewardScores`; calling it gives the total."""

    def __call__(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        return self.score(images, prompts, metadata).total

    def score(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardScores:
        raise NotImplementedError


@dataclass(frozen=True)
class RewardComponent:
    name: str  # in errors and in the metrics (reward/<name>)
    reward: Reward
    weight: float = 1.0


@dataclass(frozen=True)
class RewardScores:
    """total: [N] float32, the weighted sum; components: name -> [N] float32, each unweighted."""

    total: torch.Tensor
    components: dict[str, torch.Tensor]


class CompositeReward(RewardWithComponents):
    """The weighted sum of named rewards; a reward itself (`(images, prompts, metadata) -> [N]`)."""

    def __init__(self, components: Sequence[RewardComponent]):
        problems = []
        if not components:
            problems.append("a composite reward needs at least one component")
        names = [component.name for component in components]
        if len(set(names)) != len(names):
            problems.append(f"component names must differ, got {names}")
        slashed = [name for name in names if "/" in name]
        if slashed:
            problems.append(f"component names must not hold '/', which names a component's own components: {slashed}")
        for component in components:
            if not math.isfinite(component.weight):
                problems.append(f"the weight of {component.name!r} must be a finite number, got {component.weight}")
        if problems:
            raise ValueError("; ".join(problems))
        self.components = tuple(components)

    def score(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardScores:
        """Every component's checked scores (each followed by its own components, if it has any)
        and their weighted sum; raises RewardError naming the first component whose output is
        not one finite number per sample."""
        components: dict[str, torch.Tensor] = {}
        total = torch.zeros(len(metadata), dtype=torch.float32)
        for component in self.components:
            scores = score_component(component.name, component.reward, images, prompts, metadata)
            components[component.name] = scores.total
            components.update(scores.components)
            total = total + component.weight * scores.total
        names = ", ".join(component.name for component in self.components)
        total = checked_scores("the weighted sum of " + names, total, metadata)  # weights can overflow
        return RewardScores(total=total, components=components)


def as_composite(reward: Reward) -> CompositeReward:
    """`reward` itself if composite, else a composite of it alone (weight 1, named by `reward_name`)."""
    if isinstance(reward, CompositeReward):
        return reward
    return CompositeReward([RewardComponent(reward_name(reward), reward)])


def score_component(
    name: str, reward: Reward, images, prompts: Sequence[str], metadata: Sequence[dict]
) -> RewardScores:
    """`reward`'s checked scores [N] of the batch as `total`, with (for a `RewardWithComponents`)
    its own components' as "<name>/<component>": in one call, or, for a groupwise reward, one call
    per group (the samples of one prompt_index, in the batch's order), put back in the batch's order."""
    if not isinstance(reward, GroupwiseReward):
        return _checked_call(name, reward, images, prompts, metadata)
    missing = [row for row, meta in enumerate(metadata) if "prompt_index" not in meta]
    if missing:
        raise RewardError(
            f"reward {name!r} scores whole groups, which it finds by each sample's metadata prompt_index; "
            f"rows {missing} have none"
        )
    groups: dict[int, list[int]] = {}
    for row, meta in enumerate(metadata):
        groups.setdefault(meta["prompt_index"], []).append(row)
    images = torch.stack(list(images)) if not isinstance(images, torch.Tensor) else images
    total = torch.empty(len(metadata), dtype=torch.float32)
    components: dict[str, torch.Tensor] | None = None  # the first group's names, in its order
    for rows in groups.values():
        group = _checked_call(name, reward, images[rows], [prompts[row] for row in rows], [metadata[r] for r in rows])
        if components is None:
            components = {part: torch.empty(len(metadata), dtype=torch.float32) for part in group.components}
        if list(group.components) != list(components):
            prompt = metadata[rows[0]]["prompt_index"]
            raise RewardError(
                f"reward {name!r} gave components {list(group.components)} for prompt {prompt} but "
                f"{list(components)} for an earlier group; every group needs the same components"
            )
        total[rows] = group.total
        for part, values in group.components.items():
            components[part][rows] = values
    return RewardScores(total=total, components=components if components is not None else {})


def _checked_call(name: str, reward: Reward, images, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardScores:
    if not isinstance(reward, RewardWithComponents):
        return RewardScores(total=checked_scores(name, reward(images, prompts, metadata), metadata), components={})
    scores = reward.score(images, prompts, metadata)
    components = {
        f"{name}/{part}": checked_scores(f"{name}/{part}", values, metadata)
        for part, values in scores.components.items()
    }
    return RewardScores(total=checked_scores(name, scores.total, metadata), components=components)
