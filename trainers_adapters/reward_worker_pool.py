"""Moved to `trainers_adapters.rewards.worker_pool`; this alias warns and re-exports its names for one release."""

from rollout.imports import warn_moved
from trainers_adapters.rewards.worker_pool import *  # noqa: F403

warn_moved("trainers_adapters.reward_worker_pool", "trainers_adapters.rewards.worker_pool")
