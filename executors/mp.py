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
import selectors
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from executors.base import STARTUP, Executor, method_to_wire
from executors.bootstrap import WorkerBootstrap, worker_gpu
from executors.messages import Call, Reply, Shutdown, receive, send
from executors.mp_worker import worker_main
from executors.shm import (
    Packed,
    ReusableBlock,
    ReusedBlockReader,
    block_prefix,
    discard,
    pack,
    remove_blocks,
    remove_stale_blocks,
    unpack,
)
from rollout.config import EngineConfig
from rollout.errors import EngineDeadError, WorkerError

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
# What a registered handle of `MPExecutor._selector` is: a rank's pipe, or its process's sentinel.
_REPLY, _DEATH = "reply", "death"


@dataclass(frozen=True)
class _Sent:
    """A call in flight to one rank: its id, and the block of arguments it alone reads (removed
    once the call is answered or given up on)."""

    call_id: int
    own_arguments: Packed | None = None


class MPExecutor(Executor):
    def __init__(self, config: EngineConfig):
        stale = remove_stale_blocks()
        if stale:
            logger.info("removed %d shared-memory blocks left by engines whose process is gone", stale)
        self._prefix = block_prefix()
        self._argument_block = ReusableBlock(f"{self._prefix}-args")
        self._call_ids = itertools.count()
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._reply_readers: list[ReusedBlockReader] = []  # per rank: its reply block, kept mapped
        self._progress_cells: list = []  # per rank: its worker's progress count, shared (rollout.worker.progress)
        # Every rank's pipe and sentinel, registered once: a selector made per wait (what
        # `multiprocessing.connection.wait` does) costs several system calls on every step.
        self._selector = selectors.DefaultSelector()
        # Runs at shutdown(), at garbage collection, or at interpreter exit, whichever comes first.
        self._stop = weakref.finalize(
            self, _stop_processes, self._procs, self._conns, self._reply_readers, self._selector, self._prefix
        )
        super().__init__(config)

    # The transport (everything else is the Executor base class's).

    def _start_workers(self, bootstrap: WorkerBootstrap) -> dict[int, _Sent]:
        context = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and CUDA state
        ready = {}
        visible, gpus = os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()  # NVML: no CUDA init
        for rank in range(self.num_workers):
            parent_end, child_end = context.Pipe(duplex=True)
            ready[rank] = _Sent(next(self._call_ids))
            progress = context.RawValue("Q", 0)  # written by the worker alone: no lock
            process = context.Process(
                target=worker_main,
                args=(
                    bootstrap,
                    rank,
                    child_end,
                    ready[rank].call_id,
                    self._prefix,
                    progress,
                    worker_gpu(self.config.device, rank, visible, gpus),
                ),
                name=f"rollout-worker-{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._conns.append(parent_end)  # in place: the finalizer holds these lists
            self._procs.append(process)
            self._reply_readers.append(ReusedBlockReader())
            self._progress_cells.append(progress)
            self._selector.register(parent_end, selectors.EVENT_READ, (_REPLY, rank))
            self._selector.register(process.sentinel, selectors.EVENT_READ, (_DEATH, rank))
        return ready

    def _send_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, ranks: list[int], step: bool = False
    ) -> dict:
        wire_method = method_to_wire(method)
        if step:
            # The replicas' parts of a step are in flight together, and one may be gathered again
            # while it progresses: each rank reads a block of its own, removed once it answers.
            return {rank: self._send_own(rank, name, wire_method, (args, kwargs)) for rank in ranks}
        # One block, read (copied out) by every rank before it replies.
        arguments = pack((args, kwargs), self._prefix, self._argument_block)
        return {rank: _Sent(self._send(rank, name, wire_method, arguments)) for rank in ranks}

    def _gather(self, name: str, pending: dict[int, _Sent], timeout: float) -> dict[int, Any]:
        """Wait for every pending rank's reply, or a death, or the timeout; watching the processes'
        sentinels too is what makes a dead worker fail the call at once."""
        deadline = time.monotonic() + timeout
        answers: dict[int, Any] = {}
        try:
            while len(answers) < len(pending):
                remaining = deadline - time.monotonic()
                ready = self._selector.select(remaining) if remaining > 0 else []
                if not ready:
                    break  # the base names the ranks that did not answer
                for key, _ in ready:
                    kind, rank = key.data
                    if kind == _DEATH:
                        raise EngineDeadError(self._death_message(rank, name))
                    try:
                        reply = receive(self._conns[rank])
                    except (EOFError, OSError):
                        raise EngineDeadError(self._death_message(rank, name)) from None
                    # A rank not asked this time, or a reply to another call id: the late reply of
                    # an earlier call given up on (read now, or its pipe would stay ready).
                    if rank not in pending or rank in answers or reply.call_id != pending[rank].call_id:
                        _discard_result(reply)
                        continue
                    answers[rank] = self._answer(name, rank, reply, self._reply_readers[rank])
                if self.group_step_failed(name, answers) is not None:
                    break  # its peers may never answer: the base stops the engine
        finally:
            # A step not answered yet keeps its arguments: the base may wait for it again while it
            # progresses (else the executor dies, and its release removes every block).
            for rank, sent in pending.items():
                if sent.own_arguments is not None and rank in answers:
                    discard(sent.own_arguments)
            if any(sent.own_arguments is None for rank, sent in pending.items() if rank not in answers):
                self._argument_block.abandon()  # an RPC timed out, died or was interrupted: a rank may still read it
        return answers

    def _progress(self, ranks: list[int]) -> dict[int, int]:
        return {rank: self._progress_cells[rank].value for rank in ranks}

    def _stop_workers(self) -> None:
        for process in self._procs:  # no polite shutdown: the others may be busy for a long time
            if process.is_alive():
                process.kill()

    def _release_workers(self) -> None:
        self._argument_block.abandon()
        self._stop()

    # Internals.

    def _send_own(self, rank: int, name: str, method: str | bytes, arguments: tuple[tuple, dict]) -> _Sent:
        """Send `rank` a call whose arguments are packed in a block of its own."""
        packed = pack(arguments, self._prefix)
        try:
            return _Sent(self._send(rank, name, method, packed), packed)
        except BaseException:
            discard(packed)
            raise

    def _send(self, rank: int, name: str, method: str | bytes, arguments: Packed) -> int:
        call_id = next(self._call_ids)
        try:
            send(self._conns[rank], Call(call_id, method, arguments))
        except (BrokenPipeError, EOFError, OSError):
            raise EngineDeadError(self._death_message(rank, name)) from None
        return call_id

    @staticmethod
    def _answer(name: str, rank: int, reply: Reply, reader: ReusedBlockReader) -> Any:
        if reply.error is not None:
            return WorkerError(name, rank, reply.error_type, reply.error, reply.traceback)
        # Read now, before this rank gets its next call (which rewrites its reply block).
        return unpack(reply.result, remove=True, reader=reader)

    def _death_message(self, rank: int, name: str) -> str:
        process = self._procs[rank]
        process.join(0.1)
        message = f"worker rank {rank} (pid {process.pid}) died (exit code {process.exitcode}) during {name!r}"
        if name == STARTUP:
            message += "; a script that starts 'mp' workers needs an `if __name__ == '__main__':` guard"
        return message


def _discard_result(reply: Reply) -> None:
    if reply.result is not None:
        discard(reply.result)


def _stop_processes(procs, conns, readers, selector: selectors.BaseSelector, prefix: str) -> None:
    """Ask each worker to exit, then terminate and kill what is left; remove leftover shm blocks."""
    selector.close()
    for conn in conns:
        try:
            send(conn, Shutdown())
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
    for reader in readers:  # a mapping would keep a removed block's memory
        reader.close()
    remove_blocks(prefix)
