"""The Ray executor: one actor per worker, placed together by a placement group (one bundle per
replica, so the ranks of a replica group share a node).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from executors.base import Executor, call_wire_method, map_nested, method_to_wire
from executors.bootstrap import WorkerBootstrap
from rollout.config import EngineConfig
from rollout.errors import EngineDeadError, WorkerError

logger = logging.getLogger(__name__)

# Arguments bigger than this go to the object store once for all ranks; smaller ones travel inline
# with each call, which saves a put and a fetch (about 1 ms each here).
_PUT_ONCE_BYTES = 2**20

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# The actors' concurrency group for `RayWorkerHost.progress`: its own thread, so it answers while
# a step runs in the default group (which still serves one call at a time).
_PROGRESS_GROUP = "progress"
# How long a progress read may take; a rank that does not answer in it counts as not progressing.
_PROGRESS_READ_S = 5.0


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

    def __init__(self, bootstrap: WorkerBootstrap, rank: int):
        self.worker = bootstrap.build(rank)

    def pid(self) -> int:
        return os.getpid()

    def call(self, method: str | bytes, arguments: tuple[tuple, dict]) -> Any:
        """Run a worker method (by name) or a cloudpickled `fn(worker, *args, **kwargs)`."""
        args, kwargs = tensors_from_wire(arguments)  # private copies, as the executor contract says
        return call_wire_method(self.worker, method, args, kwargs)

    def progress(self) -> int:
        """The worker's progress count (`rollout.worker.progress`); called in its own concurrency group."""
        return self.worker.progress.count


@dataclass
class _RayHold:
    """What a Ray executor holds and frees: filled in as its workers start."""

    actors: list = field(default_factory=list)
    placement_group: Any = None
    started_ray: bool = False


class RayExecutor(Executor):
    """Options come from `EngineConfig`: `num_workers`, `threads_per_worker` (CPUs per actor),
    `device` (a GPU per actor for "cuda"), and `ray_placement_strategy` ("PACK" by default)."""

    def __init__(self, config: EngineConfig):
        self._ray = import_ray()
        self._hold = _RayHold()
        # Runs at shutdown(), at garbage collection (an engine dropped without shutdown), or at exit.
        self._free = weakref.finalize(self, _release, self._ray, self._hold)
        super().__init__(config)

    @classmethod
    def config_problems(cls, config: EngineConfig) -> list[str]:
        if config.ray_placement_strategy not in PLACEMENT_STRATEGIES:
            return [
                f"ray_placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {config.ray_placement_strategy!r}"
            ]
        return []

    # The transport (everything else is the Executor base class's).

    def _start_workers(self, bootstrap: WorkerBootstrap) -> dict:
        ray, config, hold = self._ray, self.config, self._hold
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address=os.environ["RAY_ADDRESS"])
            else:
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
                hold.started_ray = True
        threads = bootstrap.threads
        gpus = 1 if config.device.startswith("cuda") else 0
        # One bundle per replica, holding all its ranks: a bundle lies on one node, so a group's
        # ranks are placed together (STRICT_PACK inside it); the strategy places the replicas.
        ranks = self.layout.ranks_per_replica
        bundle = {"CPU": threads * ranks} | ({"GPU": gpus * ranks} if gpus else {})
        hold.placement_group = placement_group([bundle] * self.num_replicas, strategy=config.ray_placement_strategy)
        try:
            ray.get(hold.placement_group.ready(), timeout=config.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place {self.num_replicas} replicas of {bundle} ({ranks} workers each) within "
                f"{config.startup_timeout_s}s (strategy {config.ray_placement_strategy}); cluster resources: "
                f"{ray.cluster_resources()}"
            ) from None
        actor_cls = ray.remote(concurrency_groups={_PROGRESS_GROUP: 1})(RayWorkerHost)
        hold.actors += [
            actor_cls.options(
                num_cpus=threads,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=hold.placement_group,
                    placement_group_bundle_index=self.layout.replica_of(rank),
                ),
            ).remote(bootstrap, rank)
            for rank in range(self.num_workers)
        ]
        return {rank: actor.pid.remote() for rank, actor in enumerate(hold.actors)}

    def _send_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, ranks: list[int], step: bool = False
    ) -> dict:
        arguments = tensors_to_wire((args, kwargs))
        if len(ranks) > 1 and _tensor_bytes(arguments) > _PUT_ONCE_BYTES:
            arguments = self._ray.put(arguments)  # one copy in the object store, read by every rank
        wire_method = method_to_wire(method)
        return {rank: self._hold.actors[rank].call.remote(wire_method, arguments) for rank in ranks}

    def _gather(self, name: str, pending: dict, timeout: float) -> dict[int, Any]:
        """Any Ray error other than the worker function's own exception means a worker or Ray
        itself is gone: EngineDeadError."""
        ray = self._ray
        waiting = {ref: rank for rank, ref in pending.items()}
        answers = {}
        deadline = time.monotonic() + timeout
        while waiting:
            # One at a time, so a dead actor is noticed while the others are still busy.
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                break  # the late results are dropped with their refs; they never reach a later call
            rank = waiting.pop(ready[0])
            try:
                answers[rank] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as error:
                cause = error.cause
                answers[rank] = WorkerError(name, rank, WorkerError.type_path(cause), str(cause), str(error))
                if self.group_step_failed(name, answers) is not None:
                    break  # its peers may never answer: the base stops the engine
            except ray.exceptions.RayActorError as error:
                raise EngineDeadError(f"worker rank {rank} (Ray actor) died during {name!r}: {error}") from None
            except ray.exceptions.RayError as error:  # an object was lost, Ray itself failed, ...
                raise EngineDeadError(
                    f"worker rank {rank} (Ray actor) failed during {name!r}: {type(error).__name__}: {error}"
                ) from None
        return answers

    def _progress(self, ranks: list[int]) -> Mapping[int, int]:
        actors = self._hold.actors
        reads = {rank: actors[rank].progress.options(concurrency_group=_PROGRESS_GROUP).remote() for rank in ranks}
        return _ProgressReads(self._ray, reads)

    def _release_workers(self) -> None:
        self._free()


class _ProgressReads(Mapping):
    """rank -> progress count, from reads sent to the actors and waited for (at most
    `_PROGRESS_READ_S`) when first looked at: the base reads the counts as it sends a step, and
    this costs the sends alone (a round trip is ~20 times more) where the step answers in time. A
    rank whose count did not come counts as not progressing; a dead actor is an EngineDeadError."""

    def __init__(self, ray, reads: dict[int, Any]):
        self._ray = ray
        self._reads = reads
        self._counts: dict[int, int] | None = None

    def __getitem__(self, rank: int) -> int:
        return self._resolved()[rank]

    def __iter__(self):
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())

    def _resolved(self) -> dict[int, int]:
        if self._counts is not None:
            return self._counts
        ray = self._ray
        ready, _ = ray.wait(list(self._reads.values()), num_returns=len(self._reads), timeout=_PROGRESS_READ_S)
        self._counts = {}
        for rank, ref in self._reads.items():
            if ref not in ready:
                continue  # no answer in time: no sign of progress
            try:
                self._counts[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                raise EngineDeadError(f"worker rank {rank} (Ray actor) died during 'execute': {error}") from None
            except ray.exceptions.RayError as error:  # Ray could not read it: no sign of progress either
                logger.warning("could not read the progress of worker rank %d: %s", rank, error)
        return self._counts


def _release(ray, hold: _RayHold) -> None:
    """Kill the actors, free their placement group, and stop Ray if the executor started it."""
    from ray.util.placement_group import remove_placement_group

    for actor in hold.actors:
        ray.kill(actor)
    hold.actors.clear()
    if hold.placement_group is not None:
        remove_placement_group(hold.placement_group)
    if hold.started_ray:
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
