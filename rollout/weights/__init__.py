"""Weights as a worker holds them: their state and checksums, staging, broadcast groups, the files
they come from (the engine's side of a sync is `rollout.engine.weight_sync`)."""

from rollout.imports import names_moved_to

# Until this release `rollout.weights` was one module, now `rollout.weights.state`.
__getattr__ = names_moved_to("rollout.weights", "rollout.weights.state")
