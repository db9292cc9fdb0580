"""The Ray executor: one actor per worker, placed together by a placement group.

It attaches to a running Ray cluster when `ray.is_initialized()` or `RAY_ADDRESS` says there is one
(the multi-node case), and otherwise starts a local one that it also stops. Call arguments and
results travel through Ray's object store. A dead actor fails the call in flight with
`EngineDeadError`, and every later call fails fast.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import torch

from executors.base import Executor, call_wire_method, map_nested, method_to_wire
from rollout.config import EngineConfig
from rollout.errors import EngineDeadError, WorkerError
from rollout.model_runner import RunnerOutput
from rollout.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# Arguments bigger than this go to the object store once for all ranks; smaller ones travel inline
# with each call, which saves a put and a fetch (about 1 ms each here).
_PUT_ONCE_BYTES = 2**20

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(
            "executor 'ray' needs Ray: pip install 'diffusion-rollout[ray]' (or pip install 'ray[default]')"
        ) from None
    return ray


class RayWorkerHost:
    """Runs inside a Ray actor: builds the worker and serves calls one at a time."""

    def __init__(self, config_bytes: bytes, rank: int, num_threads: int):
        from rollout.worker import build_worker_class

        torch.set_num_threads(num_threads)
        config = cloudpickle.loads(config_bytes)
        self.worker = build_worker_class(config.worker_extension_cls)(config, rank)

    def pid(self) -> int:
        return os.getpid()

    def call(self, method: str | bytes, arguments: tuple[tuple, dict]) -> Any:
        """Run a worker method (by name) or a cloudpickled `fn(worker, *args, **kwargs)`."""
        args, kwargs = tensors_from_wire(arguments)  # private copies, as the executor contract says
        return call_wire_method(self.worker, method, args, kwargs)


class RayExecutor(Executor):
    """Options come from `EngineConfig`: `num_workers`, `threads_per_worker` (CPUs per actor),
    `device` (a GPU per actor for "cuda"), and `ray_placement_strategy` ("PACK" by default)."""

    @classmethod
    def config_problems(cls, config: EngineConfig) -> list[str]:
        if config.ray_placement_strategy in PLACEMENT_STRATEGIES:
            return []
        return [f"ray_placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {config.ray_placement_strategy!r}"]

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        ray = self._ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._actors: list = []
        started_ray = False
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address=os.environ["RAY_ADDRESS"])
            else:
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
                started_ray = True
        threads = config.threads_per_worker or max(1, (os.cpu_count() or 1) // self.num_workers)
        bundle = {"CPU": threads} | ({"GPU": 1} if config.device.startswith("cuda") else {})
        self._placement_group = placement_group([bundle] * self.num_workers, strategy=config.ray_placement_strategy)
        # Runs at shutdown(), at garbage collection (an engine dropped without shutdown), or at exit.
        self._release = weakref.finalize(
            self, _release, ray, remove_placement_group, self._actors, self._placement_group, started_ray
        )
        try:
            ray.get(self._placement_group.ready(), timeout=config.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._release()
            raise RuntimeError(
                f"Ray could not place {self.num_workers} workers of {bundle} within {config.startup_timeout_s}s "
                f"(strategy {config.ray_placement_strategy}); cluster resources: {ray.cluster_resources()}"
            ) from None
        actor_cls = ray.remote(RayWorkerHost)
        config_bytes = cloudpickle.dumps(config)
        self._actors += [  # in place: the finalizer holds this list
            actor_cls.options(
                num_cpus=threads,
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._placement_group, placement_group_bundle_index=rank
                ),
            ).remote(config_bytes, rank, threads)
            for rank in range(self.num_workers)
        ]
        try:
            self.pids = ray.get([actor.pid.remote() for actor in self._actors], timeout=config.startup_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            self._release()
            raise RuntimeError(f"Ray workers failed to start: {error}") from None
        logger.info("started %d Ray workers %s (%d CPUs each)", self.num_workers, self.pids, threads)

    # The transport (the failure policy is the Executor base class's).

    def _execute(self, scheduler_output: SchedulerOutput, timeout: float) -> list[RunnerOutput]:
        calls = {rank: ((work,), {}) for rank, work in scheduler_output.worker_inputs.items() if not work.is_empty}
        results = self._call_ranks("execute", "execute", calls, timeout)
        by_rank = dict(zip(calls, results, strict=True))
        return [by_rank.get(rank, RunnerOutput()) for rank in range(self.num_workers)]

    def _collective_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, timeout: float, ranks: list[int]
    ) -> list[Any]:
        arguments = tensors_to_wire((args, kwargs))
        if len(ranks) > 1 and _tensor_bytes(arguments) > _PUT_ONCE_BYTES:
            arguments = self._ray.put(arguments)  # one copy in the object store, read by every rank
        return self._call_ranks(name, method_to_wire(method), {rank: arguments for rank in ranks}, timeout)

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the executor is shut down"
        self._release()

    def _stop_workers(self) -> None:
        self._release()

    # Internals.

    def _call_ranks(self, name: str, method: str | bytes, arguments: dict, timeout: float) -> list:
        """Call `method` on each rank of `arguments` (rank -> (args, kwargs), inline or as an object
        ref, which Ray resolves in the actor); results in rank order. Any Ray error other than the
        worker function's own exception means a worker or Ray itself is gone: EngineDeadError."""
        ray = self._ray
        refs = {rank: self._actors[rank].call.remote(method, args) for rank, args in arguments.items()}
        pending = {ref: rank for rank, ref in refs.items()}
        results, errors = {}, {}
        deadline = time.monotonic() + timeout
        while pending:
            # One at a time, so a dead actor is noticed while the others are still busy.
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                # The late results are dropped with their refs; they never reach a later call.
                raise TimeoutError(
                    f"worker call {name!r} timed out after {timeout}s; "
                    f"ranks that did not answer: {sorted(pending.values())}"
                )
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as error:
                errors[rank] = error
            except ray.exceptions.RayActorError as error:
                raise EngineDeadError(f"worker rank {rank} (Ray actor) died during {name!r}: {error}") from None
            except ray.exceptions.RayError as error:  # an object was lost, Ray itself failed, ...
                raise EngineDeadError(
                    f"worker rank {rank} (Ray actor) failed during {name!r}: {type(error).__name__}: {error}"
                ) from None
        if errors:
            rank = min(errors)
            cause = errors[rank].cause
            raise WorkerError(name, rank, WorkerError.type_path(cause), str(cause), str(errors[rank]))
        return [results[rank] for rank in refs]


def _release(ray, remove_placement_group, actors: list, placement_group, started_ray: bool) -> None:
    """Kill the actors, free their placement group, and stop Ray if the executor started it."""
    for actor in actors:
        ray.kill(actor)
    actors.clear()
    remove_placement_group(placement_group)
    if started_ray:
        ray.shutdown()


@dataclass(frozen=True)
class WireTensor:
    """A tensor as raw bytes in a numpy array, which Ray moves through its object store without
    copying (torch tensors would go through `torch.save`, several times slower)."""

    data: np.ndarray  # uint8
    dtype: torch.dtype
    shape: tuple[int, ...]


def tensors_to_wire(value):
    """`value` with every tensor (directly, or in lists, tuples and dict values) as a WireTensor."""
    return map_nested(value, torch.Tensor, _to_wire)


def tensors_from_wire(value):
    """The inverse of `tensors_to_wire`; every tensor is a fresh, writable copy."""
    return map_nested(value, WireTensor, _from_wire)


def _to_wire(tensor: torch.Tensor) -> WireTensor:
    tensor = tensor.detach().to("cpu").contiguous()
    return WireTensor(tensor.reshape(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))


def _from_wire(wire: WireTensor) -> torch.Tensor:
    return torch.from_numpy(wire.data.copy()).view(wire.dtype).reshape(wire.shape)


def _tensor_bytes(value) -> int:
    """Bytes of the WireTensors in `value`."""
    sizes: list[int] = []
    map_nested(value, WireTensor, lambda wire: sizes.append(wire.data.nbytes))
    return sum(sizes)
