"""Deprecated alias, for one release: `RemoteRolloutEngine` is in the public table,
`from rollout import RemoteRolloutEngine`."""

from rollout.imports import warn_moved
from rollout.serve.client import RemoteRolloutEngine

warn_moved("trainers_adapters.remote_engine", "rollout")

__all__ = ["RemoteRolloutEngine"]
