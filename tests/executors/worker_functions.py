"""Worker functions the fault tests send through `collective_rpc`, and process checks.

Ray workers cannot import this module: tests that use Ray register it to be pickled by value.
"""

from __future__ import annotations

import os
import time


def worker_pid(worker) -> int:
    return os.getpid()


def slow_down_steps(worker, seconds: float) -> None:
    """Make every later denoising step of this worker take `seconds` longer."""
    step = worker.runner.step

    def slow_step(states):
        time.sleep(seconds)
        step(states)

    worker.runner.step = slow_step


def sleep_in_worker(worker, seconds: float) -> None:
    time.sleep(seconds)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie still answers kill(0) but has exited
        return stat.read().split()[2] != "Z"


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after `timeout` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]
