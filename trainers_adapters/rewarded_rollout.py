"""Moved to `trainers_adapters.rewards.rewarded_rollout`; this alias warns and re-exports its names for one release."""

from rollout.imports import warn_moved
from trainers_adapters.rewards.rewarded_rollout import *  # noqa: F403

warn_moved("trainers_adapters.rewarded_rollout", "trainers_adapters.rewards.rewarded_rollout")
