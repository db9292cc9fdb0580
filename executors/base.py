"""The executor contract: how the engine reaches its workers.

`execute` runs one engine step on every rank; `collective_rpc` runs any worker function on every
(or some) rank. Everything else the engine offers its users (weights, LoRA, sleep, checksums) is a
thin call over `collective_rpc`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import torch

from rollout.config import EngineConfig
from rollout.errors import EngineDeadError, WorkerError, interrupted_reason
from rollout.model_runner import RunnerOutput
from rollout.scheduler import SchedulerOutput
from rollout.worker import build_worker_class, worker_methods

logger = logging.getLogger(__name__)


class Executor(ABC):
    """Subclass this for a custom backend: start workers in `__init__`, then implement the transport
    (`_execute`, `_collective_rpc`), `_stop_workers`, `check_health` and `shutdown`. Workers are
    instances of `self.worker_cls(config, rank)`.

    The contract every backend keeps: worker functions get their own copies of the tensors in
    their arguments (the caller may change or free its tensors right after the call), and calls
    to one worker run one at a time, between engine steps.

    The failure policy is here, once, for every backend:
    - a worker exception is a `WorkerError`; the workers live on;
    - a worker that is gone is an `EngineDeadError` (the transport raises it);
    - a step that times out, or is interrupted (Ctrl-C), leaves the workers' state unknown: the
      workers are stopped and the executor is dead;
    - an RPC that times out or is interrupted raises; the worker finishes it before its next call
      and its late reply is dropped;
    - once dead, every call fails fast with `EngineDeadError` and the reason.
    """

    @classmethod
    def config_problems(cls, config: EngineConfig) -> list[str]:
        """What this backend finds wrong with `config` beyond its values (checked before any
        worker starts, with the model folder and the classes); a backend adds its own rules here."""
        return []

    def __init__(self, config: EngineConfig):
        self.config = config
        self.num_workers = config.num_workers
        self.worker_cls = build_worker_class(config.worker_extension_cls)
        self._dead: str | None = None  # why the workers can no longer be used

    def execute(self, scheduler_output: SchedulerOutput) -> list[RunnerOutput]:
        """Run one engine step; one `RunnerOutput` per rank, in rank order."""
        self._check_alive()
        try:
            return self._execute(scheduler_output, self.config.step_timeout_s)
        except WorkerError:
            raise
        except EngineDeadError as error:
            self._die(str(error))
        except TimeoutError as error:
            # A step still running in a worker cannot be trusted or waited for.
            self._die(f"{error}; create a new engine (raise step_timeout_s if steps are that slow)")
        except BaseException as error:
            self.kill(interrupted_reason(error))
            raise

    def collective_rpc(
        self,
        method: str | Callable,
        args: Sequence = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """Call `method` on the addressed ranks (all when None); results in rank order."""
        self._check_alive()
        name, _ = self.resolve_method(method)
        ranks = self.resolve_ranks(ranks)
        timeout = self.config.rpc_timeout_s if timeout is None else timeout
        try:
            return self._collective_rpc(name, method, tuple(args), dict(kwargs or {}), timeout, ranks)
        except EngineDeadError as error:
            self._die(str(error))

    @abstractmethod
    def _execute(self, scheduler_output: SchedulerOutput, timeout: float) -> list[RunnerOutput]:
        """Send each rank its part of the step and return one `RunnerOutput` per rank. Raise
        TimeoutError if a rank does not answer in `timeout` seconds, EngineDeadError if one is gone,
        WorkerError if one raised."""

    @abstractmethod
    def _collective_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, timeout: float, ranks: list[int]
    ) -> list[Any]:
        """Call `method` (a worker method name or a callable taking the worker first) on `ranks`;
        results in rank order. Raises as `_execute` does."""

    @abstractmethod
    def _stop_workers(self) -> None:
        """Stop the workers at once, whatever they are doing (the executor is dead)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if any worker cannot serve."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and free their resources. Idempotent."""

    @property
    def dead(self) -> str | None:
        """Why the workers can no longer be used (shut down, gone, interrupted); None while they can."""
        return self._dead

    def kill(self, reason: str) -> None:
        """Mark the executor dead with `reason` and stop the workers at once (no-op once dead)."""
        self._die(reason, False)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _die(self, reason: str, raise_error: bool = True) -> None:
        """Mark the executor dead, stop the workers and (unless told not to) raise EngineDeadError."""
        if self._dead is None:
            self._dead = reason
            logger.error("engine is dead: %s", reason)
            self._stop_workers()
        if raise_error:
            raise EngineDeadError(self._dead)

    # Helpers for subclasses.

    def resolve_method(self, method: str | Callable) -> tuple[str, Callable]:
        """(name for messages, function taking the worker first) for a method name or a callable."""
        if isinstance(method, str):
            available = worker_methods(self.worker_cls)
            if method not in available:
                raise ValueError(
                    f"unknown worker method {method!r}; available: {sorted(available)} "
                    "(add your own with EngineConfig(worker_extension_cls=...) or pass a callable)"
                )
            return method, getattr(self.worker_cls, method)
        if callable(method):
            return getattr(method, "__qualname__", repr(method)), method
        raise TypeError(f"collective_rpc method must be a worker method name or a callable, got {method!r}")

    def resolve_ranks(self, ranks: Sequence[int] | None) -> list[int]:
        if ranks is None:
            return list(range(self.num_workers))
        ranks = sorted(set(ranks))
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.num_workers]
        if bad or not ranks:
            raise ValueError(f"ranks must be a non-empty subset of 0..{self.num_workers - 1}, got {ranks}")
        return ranks


def method_to_wire(method: str | Callable) -> str | bytes:
    """What crosses a process boundary for `collective_rpc`'s method: the name, or the callable
    serialised with cloudpickle (so lambdas and closures work)."""
    return method if isinstance(method, str) else cloudpickle.dumps(method)


def call_wire_method(worker, method: str | bytes, args: Sequence, kwargs: dict) -> Any:
    """Run a method received through `method_to_wire` on `worker` (in the worker's process)."""
    fn = cloudpickle.loads(method) if isinstance(method, bytes) else getattr(type(worker), method)
    return fn(worker, *args, **kwargs)


def map_nested(value: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """`value` with every instance of `kind` in it (directly, or inside lists, tuples and dict
    values) replaced by `fn(instance)`."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(map_nested(item, kind, fn) for item in value)
    if isinstance(value, dict):
        return {key: map_nested(item, kind, fn) for key, item in value.items()}
    return value


def copy_tensors(value: Any) -> Any:
    """`value` with every tensor in it (directly, or inside lists, tuples and dicts) cloned."""
    return map_nested(value, torch.Tensor, lambda tensor: tensor.detach().clone())
