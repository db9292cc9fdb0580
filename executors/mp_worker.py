"""The loop a worker process runs: load the model, say ready, then serve calls one at a time.

Serving one call at a time is what guarantees that RPCs run between engine steps, never inside one.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from executors.base import call_wire_method
from executors.bootstrap import WorkerBootstrap
from executors.messages import Call, Reply, Shutdown, receive, send
from executors.shm import REPLY_BLOCK_MAX_BYTES, ReusableBlock, ReusedBlockReader, pack, unpack
from rollout.errors import WorkerError

logger = logging.getLogger(__name__)


def worker_main(
    bootstrap: WorkerBootstrap,
    rank: int,
    conn: Connection,
    ready_call_id: int,
    block_prefix: str,
    progress,
    gpu: str | None = None,
) -> None:
    """Entry point of a spawned worker process. Its first reply, to call `ready_call_id`, is its
    pid once the worker is built, or the error that building it raised (then it exits).
    `progress`: a shared cell (a `multiprocessing` `RawValue`) the worker counts its progress in,
    which the engine reads while a step runs. `gpu`: the one GPU this process sees
    (`executors.bootstrap.worker_gpu`), None to see the engine's."""
    # Ctrl-C in a terminal reaches the whole process group; the engine decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpu is not None:  # before anything initializes CUDA, which reads it once
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    block_prefix = f"{block_prefix}-r{rank}"
    try:
        worker = bootstrap.build(rank)
    except BaseException as error:  # report anything, even SystemExit, before dying
        send(conn, _error_reply(ready_call_id, error))
        return
    worker.progress.count_in(progress)
    send(conn, Reply(ready_call_id, result=pack(os.getpid(), block_prefix)))
    # Small replies (a step's finished requests, most RPC results) reuse one block; the engine
    # copies each out before it sends the next call, the only thing that makes this worker write again.
    blocks = _Blocks(ReusableBlock(f"{block_prefix}-replies", REPLY_BLOCK_MAX_BYTES), ReusedBlockReader())
    try:
        while True:
            try:
                message = receive(conn)
            except (EOFError, OSError):  # the engine is gone: nothing left to serve
                return
            if isinstance(message, Shutdown):
                return
            send(conn, _serve(worker, message, block_prefix, blocks))
    finally:
        worker.staging.close()
        blocks.replies.abandon()
        blocks.arguments.close()


@dataclass(frozen=True)
class _Blocks:
    replies: ReusableBlock  # this worker's, for its replies
    arguments: ReusedBlockReader  # the engine's RPC argument block, kept mapped


def _serve(worker, call: Call, block_prefix: str, blocks: _Blocks) -> Reply:
    try:
        # Arguments may be shared by every rank (a broadcast): the engine removes their block.
        args, kwargs = unpack(call.arguments, remove=False, reader=blocks.arguments)
        result = call_wire_method(worker, call.method, args, kwargs)
        return Reply(call.call_id, result=pack(result, block_prefix, blocks.replies))
    except Exception as error:
        return _error_reply(call.call_id, error)


def _error_reply(call_id: int, error: BaseException) -> Reply:
    return Reply(call_id, error=str(error), error_type=WorkerError.type_path(error), traceback=traceback.format_exc())
