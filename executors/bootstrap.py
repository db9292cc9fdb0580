"""How a worker comes to be where it runs: what a backend ships to each worker process or actor.

Every backend that runs workers outside the engine's process builds them the same way, with
`WorkerBootstrap.build`; the `Executor` base class makes the bootstrap and waits for every worker's
ready answer (at most `startup_timeout_s`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import cloudpickle
import torch

from rollout.config import EngineConfig
from rollout.worker import build_worker_class


def worker_threads(config: EngineConfig) -> int:
    """CPU threads of each worker's torch: `threads_per_worker`, or the machine's cores divided
    among the workers (at least one)."""
    return config.threads_per_worker or max(1, (os.cpu_count() or 1) // config.num_workers)


@dataclass(frozen=True)
class WorkerBootstrap:
    """What a worker process needs to build its worker. The config travels cloudpickled, so a
    worker extension class defined in a script or a test reaches the worker too."""

    config_bytes: bytes
    threads: int

    @classmethod
    def of(cls, config: EngineConfig) -> WorkerBootstrap:
        return cls(cloudpickle.dumps(config), worker_threads(config))

    def build(self, rank: int):
        """Set this process's torch threads, then build the worker of `rank` (loads the model)."""
        torch.set_num_threads(self.threads)
        config = cloudpickle.loads(self.config_bytes)
        return build_worker_class(config.worker_extension_cls)(config, rank)
