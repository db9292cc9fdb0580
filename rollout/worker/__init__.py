"""The worker side: a worker, its model runner, what it keeps per path, sleep levels."""

from rollout.imports import names_moved_to

# Until this release `rollout.worker` was one module, now `rollout.worker.worker`.
__getattr__ = names_moved_to("rollout.worker", "rollout.worker.worker")
