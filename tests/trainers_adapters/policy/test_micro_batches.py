"""Micro-batches split by the trajectories' sampling settings, in order, at most `size` each."""

from __future__ import annotations

from types import SimpleNamespace

from rollout.outputs import TRAJECTORY_SETTINGS
from trainers_adapters.policy.micro_batches import micro_batches


def trajectory(height: int):
    return SimpleNamespace(**dict.fromkeys(TRAJECTORY_SETTINGS, 0) | {"height": height})


def test_one_kind_is_cut_in_order_and_kinds_are_kept_apart():
    same = [(i, trajectory(32)) for i in range(5)]
    assert [[i for i, _ in b] for b in micro_batches(same, lambda item: item[1], 2)] == [[0, 1], [2, 3], [4]]
    mixed = [(i, trajectory(32 if i % 2 else 48)) for i in range(5)]
    batches = micro_batches(mixed, lambda item: item[1], 2)
    assert [[i for i, _ in b] for b in batches] == [[0, 2], [4], [1, 3]]
