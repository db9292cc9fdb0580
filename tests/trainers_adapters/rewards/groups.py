"""What the reward pool tests (processes and Ray actors) submit, and how they kill a worker mid-group."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainers_adapters.rewards.worker_queue import RewardWorkerDied


def group_of(count: int, seed: int = 0, **meta) -> tuple[torch.Tensor, list[str], list[dict]]:
    """One group of random 32x32 images, steered by `meta` in every sample's metadata (probe.py)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=generator)
    metadata = [{"prompt_index": 0, "sample_index": k, "branch_path": (), **meta} for k in range(count)]
    return images, ["a red square"] * count, metadata


def kill_while_scoring(pool, kill: Callable[[], None], died: str, started: Path):
    """Submit a group that holds the pool's only worker and one queued behind it, and `kill()` the
    worker once it scores the first: the held group fails with `died` (a pattern) within 5 s, the
    queued one as queued in the same step, and a new worker scores the next group. Returns that group
    and its scores."""
    pid = pool.pids[0]
    busy = pool.submit(*group_of(2, started=str(started), sleep_s=60.0))
    queued = pool.submit(*group_of(2, seed=1))
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline, "the worker never started scoring"
        time.sleep(0.05)
    killed = time.monotonic()
    kill()
    with pytest.raises(RewardWorkerDied, match=died):
        busy.result(timeout=10)
    assert time.monotonic() - killed < 5
    with pytest.raises(RewardWorkerDied, match="queued in the same step"):
        queued.result(timeout=10)
    group = group_of(2, seed=2)
    after = pool.submit(*group).result(timeout=180)  # a new worker scores the next step
    assert pool.pids[0] != pid
    return group, after
