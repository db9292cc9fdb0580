"""Moved to `trainers_adapters.rewards.service`; this alias warns and re-exports its names for one release."""

from rollout.imports import warn_moved
from trainers_adapters.rewards.service import *  # noqa: F403

warn_moved("trainers_adapters.reward_service", "trainers_adapters.rewards.service")

if __name__ == "__main__":  # the old command, python -m trainers_adapters.reward_service, still runs
    import sys

    sys.exit(main())  # noqa: F405
