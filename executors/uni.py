"""The in-process executor: one worker, run on a dedicated thread.

The thread lets `collective_rpc` enforce its timeout in-process and keeps worker calls strictly
serialised: a call that timed out finishes in the background before the next one starts, and its
late result is dropped, never handed to the next caller. A step still running when the executor
dies (hung, or interrupted) cannot be killed with its thread: it stops where its next unit of work
starts (`Progress.stop`). Everything but this transport (start-up,
timeouts, the failure policy, shutdown) is the `Executor` base class's.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from executors.base import Executor
from executors.bootstrap import WorkerBootstrap
from rollout.config import EngineConfig
from rollout.errors import WorkerError
from rollout.worker.progress import WorkerStopped
from rollout.worker.worker import call_function


class UniExecutor(Executor):
    # The worker shares the caller's memory: the base gives worker functions private copies of
    # their tensor arguments, as a worker process would get (the caller may reuse its tensors at once).
    shares_memory = True

    def __init__(self, config: EngineConfig):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-worker-0")
        self.worker = None  # built on the thread by _start_workers
        super().__init__(config)

    @classmethod
    def config_problems(cls, config: EngineConfig) -> list[str]:
        if isinstance(config.num_workers, int) and config.num_workers > 1:
            return [
                f"executor 'uni' runs one in-process worker, got num_workers={config.num_workers}; "
                "use executor='mp' or 'ray' for more"
            ]
        return []

    # The transport.

    def _start_workers(self, bootstrap: WorkerBootstrap) -> dict[int, Future]:
        # In-process: the worker shares the engine's config and torch threads; the bootstrap is for processes.
        return {0: self._thread.submit(self._build_worker)}

    def _send_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, ranks: list[int], step: bool = False
    ) -> dict:
        # Resolved and checked once, by the base: a name (a step's too) is looked up as a worker
        # process looks it up, and runs through the dispatch a worker process runs.
        fn = getattr(self.worker_cls, method) if isinstance(method, str) else method
        return {0: self._thread.submit(_until_stopped, self.worker, fn, args, kwargs)}

    def _gather(self, name: str, pending: dict[int, Future], timeout: float) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        answers = {}
        for rank, future in pending.items():
            try:
                answers[rank] = future.result(max(deadline - time.monotonic(), 0))
            except FutureTimeout:
                continue  # waited for again while a step progresses; else nothing reads it: dropped
            except Exception as error:
                answers[rank] = WorkerError(
                    name, rank, WorkerError.type_path(error), str(error), traceback.format_exc()
                )
        return answers

    def _progress(self, ranks: list[int]) -> dict[int, int]:
        # The worker's count, read as it grows on the worker's thread.
        return {0: self.worker.progress.count} if self.worker is not None else {}

    def _stop_workers(self) -> None:
        # A thread cannot be killed: a step still running (one declared hung, or interrupted) stops
        # where its next unit of work starts, and frees what it holds, instead of running on for
        # as long as it takes with nobody waiting for it.
        if self.worker is not None:
            self.worker.progress.stop(self.dead)

    def _release_workers(self) -> None:
        # A call still running finishes in the background; nothing waits for it or reads its result.
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.worker = None

    def _build_worker(self) -> int:
        self.worker = self.worker_cls(self.config, 0)
        return os.getpid()


def _until_stopped(worker, fn: Callable, args: Sequence, kwargs: dict) -> Any:
    """`call_function(worker, fn, args, kwargs)` on the worker's thread; None where the dead executor
    stopped it (`Progress.stop`). Nobody reads that answer, and dropping the `WorkerStopped` here
    drops its traceback, whose frames would keep the worker (its model, its requests) alive for as
    long as the future that holds it."""
    try:
        return call_function(worker, fn, args, kwargs)
    except WorkerStopped:
        return None
