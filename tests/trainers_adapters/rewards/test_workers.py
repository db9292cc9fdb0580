"""Rewards in reward worker processes: the same scores as in process, a worker killed mid-step
fails that step within seconds while the next step runs (the pool starts a new worker), a reward
that hangs fails the step at the timeout, and a worker builds its reward on its own device.

Two pools per module (the tiny CLIP's, and the probe's alone): a spawned worker imports torch and
loads its reward before its first group, about 10 s of CPU (start and stop) on the 2-core CI
machine, so the module runs in the slow suite.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from rollout import SamplingParams
from tests.trainers_adapters.rewards.groups import group_of, kill_while_scoring
from trainers_adapters.rewards.checks import RewardError
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards, group_inputs
from trainers_adapters.rewards.spec import build_reward
from trainers_adapters.rewards.worker_pool import RewardWorkerPool, RewardWorkerTimeout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROBE = "tests.trainers_adapters.rewards.probe.Probe"
PROMPTS = ["a red square", "a blue star"]


@pytest.fixture(scope="module")
def reward_key(tiny_clip):
    return {"clip_score": {"model": tiny_clip}, "colour": 0.5, "probe": {"reward": PROBE, "weight": 0.25}}


@pytest.fixture(scope="module")
def pool(reward_key):
    with RewardWorkerPool(reward_key, num_workers=1) as pool:
        yield pool


def test_a_rollout_scored_in_a_worker_equals_the_same_groups_scored_in_process(engine, pool, reward_key):
    params = SamplingParams(num_inference_steps=2, num_samples=2, seed=3)
    rollout = generate_with_rewards(engine, PROMPTS, params, pool)
    assert rollout.group_ids.tolist() == [0, 0, 1, 1]
    in_process = build_reward(reward_key)
    for index in range(len(PROMPTS)):
        rows = slice(2 * index, 2 * index + 2)
        expected = in_process.score(*group_inputs(rollout.outputs[rows], None))  # what a worker is sent
        torch.testing.assert_close(rollout.rewards[rows], expected.total, atol=1e-6, rtol=0)
        for name in ("clip_score", "colour", "probe"):
            found = rollout.reward_components[name][rows]
            torch.testing.assert_close(found, expected.components[name], atol=1e-6, rtol=0)
    assert rollout.reward_components["clip_score"].abs().sum() > 0  # the tiny CLIP scored something


def test_a_nan_from_a_worker_stops_the_step_naming_the_reward_and_the_sample(pool):
    images, prompts, metadata = group_of(3)
    metadata[1]["nan"] = True
    with pytest.raises(RewardError, match=r"reward worker 0: reward 'probe' returned nan .*prompt 0 sample 1"):
        pool.submit(images, prompts, metadata).result(timeout=60)
    assert pool.submit(*group_of(2)).result(timeout=60).total.shape == (2,)  # the worker carries on


def test_a_worker_killed_mid_step_fails_the_step_within_seconds_and_the_next_step_runs(pool, reward_key, tmp_path):
    pid = pool.pids[0]
    died = rf"reward worker 0 \(pid {pid}\) died with exit code -9 \(killed by SIGKILL\)"
    (images, prompts, metadata), after = kill_while_scoring(
        pool, lambda: os.kill(pid, signal.SIGKILL), died, tmp_path / "started"
    )
    expected = build_reward(reward_key).score(images, prompts, metadata)
    torch.testing.assert_close(after.total, expected.total, atol=1e-6, rtol=0)


def test_a_reward_that_fails_to_build_fails_the_pool_start_with_its_error():
    with pytest.raises(ValueError, match=r"reward worker 0 could not build the reward: Probe was told to fail"):
        RewardWorkerPool({"probe": {"reward": PROBE, "fail_to_build": True}}, num_workers=1, start_timeout_s=120)


@pytest.fixture(scope="module")
def probe_pool():
    """A pool of the probe alone (no CLIP to load) on a named device, with a short timeout."""
    with RewardWorkerPool({"probe": {"reward": PROBE}}, num_workers=1, devices=["cpu"], timeout_s=3.0) as pool:
        yield pool


def test_a_worker_builds_its_reward_on_its_device(probe_pool, tmp_path):
    device_file = tmp_path / "device"
    probe_pool.submit(*group_of(2, device_to=str(device_file))).result(timeout=60)
    assert device_file.read_text() == "cpu"  # the pool's device became the reward's device setting


def test_a_reward_that_hangs_fails_the_step_at_the_timeout_and_the_worker_is_restarted(probe_pool, tmp_path):
    started = tmp_path / "started"
    pid = probe_pool.pids[0]
    submitted = time.monotonic()
    hung = probe_pool.submit(*group_of(2, started=str(started), sleep_s=3600.0))
    queued = probe_pool.submit(*group_of(2, seed=1))
    timed_out = r"reward worker 0 \(pid \d+\) did not answer within 3 s \(reward_timeout_s\) .* reward 1\*probe"
    with pytest.raises(RewardWorkerTimeout, match=timed_out):
        hung.result(timeout=30)
    assert started.exists() and time.monotonic() - submitted < 3.0 + 10  # the timeout, plus the kill
    with pytest.raises(RewardWorkerTimeout, match="queued in the same step"):
        queued.result(timeout=10)
    images, prompts, metadata = group_of(2, seed=2)
    after = probe_pool.submit(images, prompts, metadata).result(timeout=180)  # a new worker, the next step
    assert probe_pool.pids[0] != pid
    torch.testing.assert_close(after.total, images.float().mean(dim=(1, 2, 3)) / 255, atol=1e-6, rtol=0)
