"""The engine side: the engines a trainer drives, the scheduler, requests, step reports."""

from rollout.imports import names_moved_to

# Until this release `rollout.engine` was one module, now `rollout.engine.rollout_engine`.
__getattr__ = names_moved_to("rollout.engine", "rollout.engine.rollout_engine")
