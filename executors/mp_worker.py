"""The loop a worker process runs: load the model, say ready, then serve calls one at a time.

Serving one call at a time is what guarantees that RPCs run between engine steps, never inside one.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from multiprocessing.connection import Connection

import cloudpickle
import torch

from executors.base import call_wire_method
from executors.messages import Call, Ready, Reply, Shutdown, StartupFailed
from executors.shm import pack, unpack
from rollout.errors import WorkerError

logger = logging.getLogger(__name__)


def worker_main(config_bytes: bytes, rank: int, conn: Connection, num_threads: int, block_prefix: str) -> None:
    """Entry point of a spawned worker process."""
    from rollout.worker import build_worker_class

    # Ctrl-C in a terminal reaches the whole process group; the engine decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    try:
        config = cloudpickle.loads(config_bytes)
        worker = build_worker_class(config.worker_extension_cls)(config, rank)
    except BaseException as error:  # report anything, even SystemExit, before dying
        conn.send(StartupFailed(rank, f"{type(error).__name__}: {error}", traceback.format_exc()))
        return
    conn.send(Ready(rank, os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the engine is gone: nothing left to serve
            return
        if isinstance(message, Shutdown):
            return
        conn.send(_serve(worker, message, f"{block_prefix}-r{rank}"))


def _serve(worker, call: Call, block_prefix: str) -> Reply:
    try:
        # Arguments may be shared by every rank (a broadcast): the engine removes their block.
        args, kwargs = unpack(call.arguments, remove=False)
        result = call_wire_method(worker, call.method, args, kwargs)
        return Reply(call.call_id, result=pack(result, block_prefix))
    except Exception as error:
        return Reply(
            call.call_id, error=str(error), error_type=WorkerError.type_path(error), traceback=traceback.format_exc()
        )
