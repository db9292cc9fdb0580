"""The in-process executor: one worker, run on a dedicated thread.

The thread lets `collective_rpc` enforce its timeout in-process and keeps worker calls strictly
serialised: a call that timed out finishes in the background before the next one starts, and its
late result is dropped, never handed to the next caller. The failure policy (timeouts, interrupts,
a dead engine) is the `Executor` base class's.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from executors.base import Executor, copy_tensors
from rollout.config import EngineConfig
from rollout.errors import WorkerError
from rollout.model_runner import RunnerOutput
from rollout.scheduler import SchedulerOutput


class UniExecutor(Executor):
    @classmethod
    def config_problems(cls, config: EngineConfig) -> list[str]:
        if config.num_workers == 1:
            return []
        return [
            f"executor 'uni' runs one in-process worker, got num_workers={config.num_workers}; "
            "use executor='mp' or 'ray' for more"
        ]

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-worker-0")
        self.worker = self._call("start worker", lambda: self.worker_cls(config, 0), timeout=None)

    def _execute(self, scheduler_output: SchedulerOutput, timeout: float) -> list[RunnerOutput]:
        work = scheduler_output.worker_inputs[0]
        return [self._call("execute", lambda: self.worker.execute(work), timeout)]

    def _collective_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, timeout: float, ranks: list[int]
    ) -> list[Any]:
        _, fn = self.resolve_method(method)
        # Private copies, as a worker process would get: the caller may reuse its tensors at once.
        args, kwargs = copy_tensors((args, kwargs))
        return [self._call(name, lambda: fn(self.worker, *args, **kwargs), timeout)]

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the executor is shut down"
        self._stop_workers()

    def _stop_workers(self) -> None:
        # A step still running finishes in the background; nothing waits for it or reads its result.
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.worker = None

    def _call(self, name: str, fn: Callable[[], Any], timeout: float | None) -> Any:
        future = self._thread.submit(fn)
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"worker call {name!r} timed out after {timeout}s; ranks that did not answer: [0]"
            ) from None
        except Exception as error:
            raise WorkerError(name, 0, WorkerError.type_path(error), str(error), traceback.format_exc()) from error
