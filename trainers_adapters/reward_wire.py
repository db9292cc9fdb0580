"""Moved to `trainers_adapters.rewards.wire`; this alias warns and re-exports its names for one release."""

from rollout.imports import warn_moved
from trainers_adapters.rewards.wire import *  # noqa: F403

warn_moved("trainers_adapters.reward_wire", "trainers_adapters.rewards.wire")
