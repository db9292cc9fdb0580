"""Where a recipe's rewards run, from its keys `reward_workers`, `reward_runner`, `reward_devices`
and `reward_timeout_s`: on a thread of the trainer's process (0 workers), in reward worker
processes (`RewardWorkerPool`), or in Ray actors (`RayRewardPool`, on a local Ray or a cluster).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainers_adapters.rewards.ray_pool import RayRewardPool, ray_device_problem
from trainers_adapters.rewards.runner import RewardRunner, RewardsOnThreads
from trainers_adapters.rewards.spec import RewardValue, build_reward, device_conflicts
from trainers_adapters.rewards.worker_pool import RewardWorkerPool

RUNNERS = ("process", "ray")  # what reward_runner may name


def placement_problems(
    workers: int,
    runner: str = "process",
    devices: Sequence[str] | None = None,
    timeout_s: float = 600.0,
    reward: RewardValue | None = None,
) -> list[str]:
    """What is wrong with these keys (every problem), found without starting anything; `reward`
    (when given) is checked for components that name their own device beside reward_devices."""
    problems = []
    if workers < 0:
        problems.append(f"reward_workers must be >= 0 (0: score on a thread of this process), got {workers}")
    if runner not in RUNNERS:
        problems.append(f"reward_runner must be one of {RUNNERS} (worker processes or Ray actors), got {runner!r}")
    elif runner == "ray" and workers == 0:
        problems.append("reward_runner 'ray' needs reward_workers >= 1: the number of Ray actors scoring rewards")
    if not timeout_s > 0:
        problems.append(f"reward_timeout_s must be > 0 seconds, got {timeout_s}")
    if devices is None:
        return problems
    if workers == 0:
        problems.append("reward_devices places reward workers, but reward_workers is 0; set reward_workers")
    elif len(devices) != workers:
        problems.append(
            f"reward_devices names {len(devices)} devices for reward_workers {workers}; give one device per worker"
        )
    for device in devices:
        problems += _device_problems(device, runner)
    if reward is not None:
        problems += device_conflicts(reward)
    return problems


def _device_problems(device, runner: str) -> list[str]:
    try:
        torch.device(device)  # parses it
    except (RuntimeError, TypeError):
        return [f"reward_devices: {device!r} is not a device; write cpu, cuda or cuda:N"]
    problem = ray_device_problem(device) if runner == "ray" else None
    return [] if problem is None else [f"reward_devices: {problem}"]


def open_reward_runner(
    reward: RewardValue,
    workers: int = 0,
    *,
    runner: str = "process",
    devices: Sequence[str] | None = None,
    timeout_s: float = 600.0,
) -> RewardRunner:
    """The runner of a recipe's `reward:` key: on a thread of this process (`workers` 0: the models
    load here), or `workers` reward workers of the kind `runner` names (each loads them), on
    `devices` (one per worker; None: where the reward's settings say), each group allowed
    `timeout_s` in a worker. Raises ValueError listing every problem of these settings."""
    problems = placement_problems(workers, runner, devices, timeout_s, reward)
    if problems:
        raise ValueError("; ".join(problems))
    if workers == 0:
        return RewardsOnThreads(build_reward(reward))
    pool_class = RayRewardPool if runner == "ray" else RewardWorkerPool
    return pool_class(reward, num_workers=workers, devices=devices, timeout_s=timeout_s)
