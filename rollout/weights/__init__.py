"""Weights: their state and checksums, pushes and syncs, hot swaps, the files they come from."""

from rollout.imports import names_moved_to

# Until this release `rollout.weights` was one module, now `rollout.weights.state`.
__getattr__ = names_moved_to("rollout.weights", "rollout.weights.state")
