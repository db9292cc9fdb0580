"""The multi-process executor: `num_workers` spawned processes, each a full model replica.

Control messages go over one pipe per worker (see `executors.messages`); tensors go through shared
memory (see `executors.shm`). Every wait also watches the worker processes' sentinels, so a worker
that dies (killed, crashed, out of memory) fails the call in flight at once with `EngineDeadError`,
and every later call fails fast with the same error. Workers never outlive the engine: `shutdown`,
garbage collection, interpreter exit and a dead sibling all stop them.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle

from executors.base import Executor, method_to_wire
from executors.messages import Call, Ready, Reply, Shutdown, StartupFailed
from executors.mp_worker import worker_main
from executors.shm import (
    Packed,
    ReusableBlock,
    block_prefix,
    discard,
    pack,
    remove_blocks,
    remove_stale_blocks,
    unpack,
)
from rollout.config import EngineConfig
from rollout.errors import EngineDeadError, WorkerError
from rollout.model_runner import RunnerOutput
from rollout.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0


class MPExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        stale = remove_stale_blocks()
        if stale:
            logger.info("removed %d shared-memory blocks left by engines whose process is gone", stale)
        self._prefix = block_prefix()
        self._argument_block = ReusableBlock(self._prefix)
        self._call_ids = itertools.count()
        context = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and CUDA state
        threads = config.threads_per_worker or max(1, (os.cpu_count() or 1) // self.num_workers)
        config_bytes = cloudpickle.dumps(config)
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(self.num_workers):
            parent_end, child_end = context.Pipe(duplex=True)
            process = context.Process(
                target=worker_main,
                args=(config_bytes, rank, child_end, threads, self._prefix),
                name=f"rollout-worker-{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(process)
        # Runs at shutdown(), at garbage collection, or at interpreter exit, whichever comes first.
        self._stop = weakref.finalize(self, _stop_processes, self._procs, self._conns, self._prefix)
        self.pids = self._await_ready(config.startup_timeout_s)
        logger.info("started %d worker processes %s (%d torch threads each)", self.num_workers, self.pids, threads)

    # The transport (the failure policy is the Executor base class's).

    def _execute(self, scheduler_output: SchedulerOutput, timeout: float) -> list[RunnerOutput]:
        calls = {
            rank: ("execute", pack(((work,), {}), self._prefix))
            for rank, work in scheduler_output.worker_inputs.items()
            if not work.is_empty
        }
        try:
            replies = self._round("execute", calls, timeout)
        finally:
            for _, arguments in calls.values():
                discard(arguments)
        results = self._results("execute", replies)
        return [results.get(rank, RunnerOutput()) for rank in range(self.num_workers)]

    def _collective_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, timeout: float, ranks: list[int]
    ) -> list[Any]:
        wire_method = method_to_wire(method)
        # One block, read (copied out) by every rank before it replies.
        arguments = pack((args, kwargs), self._prefix, self._argument_block)
        try:
            replies = self._round(name, {rank: (wire_method, arguments) for rank in ranks}, timeout)
        except BaseException as error:
            if not isinstance(error, WorkerError):  # timed out or interrupted: a rank may still be reading it
                self._argument_block.abandon()
            raise
        results = self._results(name, replies)
        return [results[rank] for rank in ranks]

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the executor is shut down"
        self._argument_block.abandon()
        self._stop()

    def _stop_workers(self) -> None:
        for process in self._procs:  # no polite shutdown: the others may be busy for a long time
            if process.is_alive():
                process.kill()
        self._argument_block.abandon()
        self._stop()

    # Internals.

    def _round(self, name: str, calls: dict[int, tuple[str | bytes, Packed]], timeout: float | None) -> dict:
        """Send one call to each addressed rank, then wait for all replies (or a death, or the timeout)."""
        expected = {}
        for rank, (method, arguments) in calls.items():
            call_id = next(self._call_ids)
            try:
                self._conns[rank].send(Call(call_id, method, arguments))
            except (BrokenPipeError, EOFError, OSError):
                raise EngineDeadError(self._death_message(rank, name)) from None
            expected[rank] = call_id
        return self._gather(name, expected, timeout)

    def _gather(self, name: str, expected: dict[int, int], timeout: float) -> dict[int, Reply]:
        deadline = time.monotonic() + timeout
        replies: dict[int, Reply] = {}
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._procs)}
        while len(replies) < len(expected):
            pending = {self._conns[rank]: rank for rank in expected if rank not in replies}
            remaining = deadline - time.monotonic()
            ready = wait([*pending, *sentinels], timeout=max(remaining, 0)) if remaining > 0 else []
            if not ready:
                self._discard_results(replies)
                raise TimeoutError(
                    f"worker call {name!r} timed out after {timeout}s; "
                    f"ranks that did not answer: {sorted(pending.values())}"
                )
            for handle in ready:
                if handle in sentinels:
                    raise EngineDeadError(self._death_message(sentinels[handle], name))
                rank = pending[handle]
                try:
                    reply = handle.recv()
                except (EOFError, OSError):
                    raise EngineDeadError(self._death_message(rank, name)) from None
                if reply.call_id != expected[rank]:  # the late reply of an earlier, timed-out call
                    self._discard_results({rank: reply})
                    continue
                replies[rank] = reply
        return replies

    def _results(self, name: str, replies: dict[int, Reply]) -> dict[int, Any]:
        failed = sorted(rank for rank, reply in replies.items() if reply.error is not None)
        if failed:
            self._discard_results(replies)
            reply = replies[failed[0]]
            raise WorkerError(name, failed[0], reply.error_type, reply.error, reply.traceback)
        return {rank: unpack(reply.result, remove=True) for rank, reply in replies.items()}

    @staticmethod
    def _discard_results(replies: dict[int, Reply]) -> None:
        for reply in replies.values():
            if reply.result is not None:
                discard(reply.result)

    def _await_ready(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        pids: dict[int, int] = {}
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._procs)}
        while len(pids) < self.num_workers:
            pending = {self._conns[rank]: rank for rank in range(self.num_workers) if rank not in pids}
            ready = wait([*pending, *sentinels], timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                self._stop()
                raise RuntimeError(f"worker ranks {sorted(pending.values())} did not start within {timeout}s")
            for handle in ready:
                if handle in pending:
                    try:
                        message = handle.recv()
                    except (EOFError, OSError):  # it died before saying anything; its sentinel says how
                        continue
                    if isinstance(message, StartupFailed):
                        self._stop()
                        raise RuntimeError(
                            f"worker rank {message.rank} failed to start: {message.error}\n"
                            f"--- worker traceback ---\n{message.traceback}"
                        )
                    assert isinstance(message, Ready)
                    pids[message.rank] = message.pid
                else:
                    rank = sentinels[handle]
                    self._procs[rank].join(1.0)
                    self._stop()
                    raise RuntimeError(
                        f"worker rank {rank} exited during start-up (exit code {self._procs[rank].exitcode}); "
                        "a script that starts 'mp' workers needs an `if __name__ == '__main__':` guard"
                    )
        return [pids[rank] for rank in range(self.num_workers)]

    def _death_message(self, rank: int, name: str) -> str:
        process = self._procs[rank]
        process.join(0.1)
        return f"worker rank {rank} (pid {process.pid}) died (exit code {process.exitcode}) during {name!r}"


def _stop_processes(procs, conns, prefix: str) -> None:
    """Ask each worker to exit, then terminate and kill what is left; remove leftover shm blocks."""
    for conn in conns:
        try:
            conn.send(Shutdown())
        except (BrokenPipeError, EOFError, OSError):
            pass
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    for process in procs:
        process.join(max(deadline - time.monotonic(), 0))
    for process in procs:
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join(1.0)
    for conn in conns:
        conn.close()
    remove_blocks(prefix)
