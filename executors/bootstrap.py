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

from executors import last_resort
from executors.replica_groups import GroupRendezvous
from rollout.config import EngineConfig
from rollout.worker.worker import build_worker_class


def worker_threads(config: EngineConfig) -> int:
    """CPU threads of each worker's torch: `threads_per_worker`, or the machine's cores divided
    among the workers (every rank of every replica group; at least one)."""
    return config.threads_per_worker or max(1, (os.cpu_count() or 1) // config.num_workers)


def worker_gpu(device: str, rank: int, visible: str | None, count: int) -> str | None:
    """The `CUDA_VISIBLE_DEVICES` of the worker process of `rank` on one machine (`mp`): one GPU of
    the `count` this process sees (`visible`: its own `CUDA_VISIBLE_DEVICES`, None if unset), GPU
    rank % count, where `device` is "cuda" and several GPUs are visible; None (the process sees what
    this one sees) otherwise: on the CPU, on one GPU, or where `device` names its GPU ("cuda:1").

    Each worker then sees one GPU, its "cuda": the ranks of a replica group lie on distinct GPUs
    while it has no more ranks than there are GPUs, and diffusers, which puts a rank of a group on
    device `rank % torch.accelerator.device_count()`, finds it on the only one it sees."""
    if device != "cuda" or count < 2:
        return None
    gpus = visible.split(",") if visible else [str(index) for index in range(count)]
    return gpus[rank % count].strip()


@dataclass(frozen=True)
class WorkerBootstrap:
    """What a worker process needs to build its worker. The config travels cloudpickled, so a
    worker extension class defined in a script or a test reaches the worker too. `rendezvous`:
    where the ranks of each replica group meet, for replicas of several ranks."""

    config_bytes: bytes
    threads: int
    rendezvous: GroupRendezvous | None = None

    @classmethod
    def of(cls, config: EngineConfig, rendezvous: GroupRendezvous | None = None) -> WorkerBootstrap:
        return cls(cloudpickle.dumps(config), worker_threads(config), rendezvous)

    def build(self, rank: int):
        """Set this process's torch threads, then build the worker of `rank` (loads the model and,
        in a replica group of several ranks, joins the group)."""
        torch.set_num_threads(self.threads)
        last_resort.install()  # as the engine's process does: a worker's warnings carry a format
        config = cloudpickle.loads(self.config_bytes)
        worker_cls = build_worker_class(config.worker_extension_cls)
        if self.rendezvous is None:
            return worker_cls(config, rank)
        return worker_cls(config, rank, group=self.rendezvous.member(rank))
