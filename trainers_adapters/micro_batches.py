"""Micro-batches that one re-scoring forward can take.

A forward batches transitions of trajectories that share their sampling settings (image size,
sampler, guidance, ...: `rollout.outputs.TRAJECTORY_SETTINGS`). One rollout may mix them, for example
edits of input images of different sizes, so the trainers split their minibatches by kind first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

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
