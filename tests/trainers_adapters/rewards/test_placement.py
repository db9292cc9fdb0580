"""Where rewards run, checked before any worker starts: one device per worker, each built into the
specs that take one, a reward naming its own device refused beside them."""

from __future__ import annotations

import pytest

from trainers_adapters.rewards.placement import open_reward_runner
from trainers_adapters.rewards.runner import RewardsOnThreads
from trainers_adapters.rewards.spec import reward_specs
from trainers_adapters.rewards.worker_pool import RewardWorkerPool

pytestmark = pytest.mark.timeout(30)

PROBE = "tests.trainers_adapters.rewards.probe.Probe"


def test_a_worker_device_becomes_the_device_setting_of_the_rewards_that_take_one(tiny_clip):
    clip, colour, probe = reward_specs({"clip_score": {"model": tiny_clip}, "colour": 0.5, "probe": {"reward": PROBE}})
    assert clip.placed_on("cuda:1").settings == {"model": tiny_clip, "device": "cuda:1"}
    assert probe.placed_on("cpu").settings == {"device": "cpu"}
    assert colour.placed_on("cuda:1") is colour  # a function runs where it runs
    (named,) = reward_specs({"probe": {"reward": PROBE, "device": "cpu"}})
    with pytest.raises(ValueError, match=r"reward.probe.device is set, and reward_devices places every worker"):
        named.placed_on("cpu")


def test_a_pool_refuses_devices_that_do_not_fit_before_any_worker_starts():
    with pytest.raises(ValueError, match="devices names 1 devices for 2 reward workers; give one per worker"):
        RewardWorkerPool({"probe": {"reward": PROBE}}, num_workers=2, devices=["cpu"])
    with pytest.raises(ValueError, match="reward.probe.device is set"):
        RewardWorkerPool({"probe": {"reward": PROBE, "device": "cpu"}}, num_workers=1, devices=["cpu"])
    with pytest.raises(ValueError, match=r"timeout_s \(reward_timeout_s\) must be > 0 seconds, got 0"):
        RewardWorkerPool({"probe": {"reward": PROBE}}, num_workers=1, timeout_s=0)
    with pytest.raises(ValueError, match=r"reward_runner must be one of \('process', 'ray'\)"):
        open_reward_runner("colour", 1, runner="thread")
    with open_reward_runner("colour") as runner:
        assert isinstance(runner, RewardsOnThreads)
