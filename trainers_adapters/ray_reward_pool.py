"""Moved to `trainers_adapters.rewards.ray_pool`; this alias warns and re-exports its names for one release."""

from rollout.imports import warn_moved
from trainers_adapters.rewards.ray_pool import *  # noqa: F403

warn_moved("trainers_adapters.ray_reward_pool", "trainers_adapters.rewards.ray_pool")
