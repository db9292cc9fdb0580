"""Moved to `trainers_adapters.rewards.checks`; this alias warns and re-exports its names for one release."""

from rollout.imports import warn_moved
from trainers_adapters.rewards.checks import *  # noqa: F403

warn_moved("trainers_adapters.reward_checks", "trainers_adapters.rewards.checks")
