"""Rewards in Ray actors: the same scores as in process, and an actor killed (`ray.kill`) mid-group
fails that step within seconds with `RewardWorkerDied` while the next group is scored by a new actor.

The pool starts a local Ray (and stops it): that and each actor's start (torch, the tiny CLIP) take
tens of seconds of CPU on the 2-core CI machine, so the module runs in the slow suite.
"""

from __future__ import annotations

import pytest
import torch

from tests.trainers_adapters.rewards.groups import group_of, kill_while_scoring
from trainers_adapters.rewards.spec import build_reward

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROBE = "tests.trainers_adapters.rewards.probe.Probe"


@pytest.fixture(scope="module")
def reward_key(tiny_clip):
    return {"clip_score": {"model": tiny_clip}, "colour": 0.5, "probe": {"reward": PROBE, "weight": 0.25}}


@pytest.fixture(scope="module")
def pool(reward_key):
    pytest.importorskip("ray")
    from trainers_adapters.rewards.ray_pool import RayRewardPool

    with RayRewardPool(reward_key, num_workers=1, devices=["cpu"]) as pool:
        yield pool


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

    actor, pid = pool.actors[0], pool.pids[0]
    died = rf"reward worker 0 \(Ray actor, pid {pid}\) died while scoring prompt 0 sample 0, prompt 0 sample 1"
    _, after = kill_while_scoring(pool, lambda: ray.kill(actor), died, tmp_path / "started")
    assert after.total.shape == (2,) and torch.isfinite(after.total).all()
