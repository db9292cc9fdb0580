"""Rewards in Ray actors: the same scores as in process, and an actor killed (`ray.kill`) mid-group
fails that step within seconds with `RewardWorkerDied` while the next group is scored by a new actor.

The pool starts a local Ray (and stops it): that and each actor's start (torch, the tiny CLIP) take
tens of seconds of CPU on the 2-core CI machine, so the module runs in the slow suite.
"""

from __future__ import annotations

import time

import pytest
import torch

from trainers_adapters.reward_spec import build_reward
from trainers_adapters.reward_worker_queue import RewardWorkerDied

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROBE = "tests.trainers_adapters.reward_probe.Probe"


@pytest.fixture(scope="module")
def reward_key(tiny_clip):
    return {"clip_score": {"model": tiny_clip}, "colour": 0.5, "probe": {"reward": PROBE, "weight": 0.25}}


@pytest.fixture(scope="module")
def pool(reward_key):
    pytest.importorskip("ray")
    from trainers_adapters.ray_reward_pool import RayRewardPool

    with RayRewardPool(reward_key, num_workers=1, devices=["cpu"]) as pool:
        yield pool


def group_of(count: int, seed: int = 0, **meta):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=generator)
    metadata = [{"prompt_index": 0, "sample_index": k, "branch_path": (), **meta} for k in range(count)]
    return images, ["a red square"] * count, metadata


def test_a_group_scored_in_an_actor_equals_the_group_scored_in_process(pool, reward_key):
    images, prompts, metadata = group_of(3)
    found = pool.submit(images, prompts, metadata).result(timeout=120)
    expected = build_reward(reward_key).score(images, prompts, metadata)
    torch.testing.assert_close(found.total, expected.total, atol=1e-6, rtol=0)
    assert list(found.components) == ["clip_score", "colour", "probe"]
    for name, scores in expected.components.items():
        torch.testing.assert_close(found.components[name], scores, atol=1e-6, rtol=0)


def test_an_actor_killed_mid_group_fails_the_step_within_seconds_and_the_next_group_is_scored(pool, tmp_path):
    import ray

    started = tmp_path / "started"
    actor, pid = pool.actors[0], pool.pids[0]
    busy = pool.submit(*group_of(2, started=str(started), sleep_s=60.0))
    queued = pool.submit(*group_of(2, seed=1))
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline, "the actor never started scoring"
        time.sleep(0.05)
    killed = time.monotonic()
    ray.kill(actor)
    died = rf"reward worker 0 \(Ray actor, pid {pid}\) died while scoring prompt 0 sample 0, prompt 0 sample 1"
    with pytest.raises(RewardWorkerDied, match=died):
        busy.result(timeout=10)
    assert time.monotonic() - killed < 5
    with pytest.raises(RewardWorkerDied, match="queued in the same step"):
        queued.result(timeout=10)
    images, prompts, metadata = group_of(2, seed=2)
    after = pool.submit(images, prompts, metadata).result(timeout=180)  # a new actor scores the next step
    assert pool.pids[0] != pid
    assert after.total.shape == (2,) and torch.isfinite(after.total).all()
