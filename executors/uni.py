"""The in-process executor: one worker, run on a dedicated thread.

The thread lets `collective_rpc` enforce its timeout in-process and keeps worker calls strictly
serialised: a call that timed out finishes in the background before the next one starts, and its
late result is dropped, never handed to the next caller.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from executors.base import Executor, copy_tensors
from rollout.config import EngineConfig
from rollout.errors import EngineDeadError, WorkerError
from rollout.model_runner import RunnerOutput
from rollout.scheduler import SchedulerOutput


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self._dead: str | None = None  # why the worker can no longer be used
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-worker-0")
        self.worker = self._call("start worker", lambda: self.worker_cls(config, 0), timeout=None)

    def execute(self, scheduler_output: SchedulerOutput) -> list[RunnerOutput]:
        work = scheduler_output.worker_inputs[0]
        try:
            return [self._call("execute", lambda: self.worker.execute(work), self.config.step_timeout_s)]
        except TimeoutError:
            # The step may still finish in the background; its requests' state can no longer be
            # trusted, so the engine stops rather than return a mix of old and new work.
            self._dead = (
                f"an engine step did not finish within step_timeout_s={self.config.step_timeout_s}s; "
                "create a new engine (raise step_timeout_s if steps are legitimately that slow)"
            )
            raise EngineDeadError(self._dead) from None

    def collective_rpc(
        self,
        method: str | Callable,
        args: Sequence = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        name, fn = self.resolve_method(method)
        self.resolve_ranks(ranks)
        # Private copies, as a worker process would get: the caller may reuse its tensors at once.
        args, kwargs = copy_tensors((tuple(args), dict(kwargs or {})))
        timeout = self.config.rpc_timeout_s if timeout is None else timeout
        return [self._call(name, lambda: fn(self.worker, *args, **kwargs), timeout)]

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.worker = None

    def _call(self, name: str, fn: Callable[[], Any], timeout: float | None) -> Any:
        if self._dead:
            raise EngineDeadError(self._dead)
        future = self._thread.submit(fn)
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"worker call {name!r} timed out after {timeout}s; ranks that did not answer: [0]"
            ) from None
        except Exception as error:
            raise WorkerError(name, 0, WorkerError.type_path(error), str(error), traceback.format_exc()) from error
