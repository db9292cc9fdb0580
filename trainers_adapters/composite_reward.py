"""Moved to `trainers_adapters.rewards.composite`; this alias warns and re-exports its names for one release."""

from rollout.imports import warn_moved
from trainers_adapters.rewards.composite import *  # noqa: F403

warn_moved("trainers_adapters.composite_reward", "trainers_adapters.rewards.composite")
