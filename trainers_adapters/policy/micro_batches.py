"""Micro-batches that one re-scoring forward can take, and re-scoring through them without gradient.

A forward batches transitions of trajectories that share their sampling settings (image size,
sampler, guidance, ...: `rollout.outputs.TRAJECTORY_SETTINGS`). One rollout may mix them, for example
edits of input images of different sizes, so the trainers split their minibatches by kind first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from rollout.outputs import TRAJECTORY_SETTINGS, Trajectory

Item = TypeVar("Item")


def micro_batches(items: Sequence[Item], trajectory_of: Callable[[Item], Trajectory], size: int) -> list[list[Item]]:
    """`items` in micro-batches of at most `size` whose trajectories share their sampling settings,
    each kind in its first appearance's place, and the items' order kept within a kind (a rollout of
    one kind is cut exactly as `items[i:i + size]`)."""
    kinds: dict[tuple, list[Item]] = {}
    for item in items:
        trajectory = trajectory_of(item)
        kinds.setdefault(tuple(getattr(trajectory, name) for name in TRAJECTORY_SETTINGS), []).append(item)
    return [kind[start : start + size] for kind in kinds.values() for start in range(0, len(kind), size)]


def log_probs_without_grad(
    policy, items: Sequence[Item], transition_of: Callable[[Item], tuple[Trajectory, int]], size: int
) -> dict[Item, torch.Tensor]:
    """item -> the log-prob (float32 scalar) that `policy` (a `LoraPolicy`, as it is now) gives its
    transition (trajectory, step index), scored without gradient in `micro_batches` of `size`."""
    found = {}
    with torch.no_grad():
        for chunk in micro_batches(items, lambda item: transition_of(item)[0], size):
            trajectories, steps = zip(*(transition_of(item) for item in chunk), strict=True)
            scored = policy.score(list(trajectories), list(steps))
            found |= dict(zip(chunk, scored.log_prob.float(), strict=True))
    return found
