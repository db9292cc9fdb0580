"""Fixtures for executor tests: a Ray cluster, and checks that worker processes are gone."""

from __future__ import annotations

import os
import time

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A small local Ray cluster for the whole session; Ray executors attach to it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie still answers kill(0) but has exited
        return stat.read().split()[2] != "Z"


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after `timeout` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


@pytest.fixture
def wait_gone():
    """wait_gone(pids, timeout=10.0) -> the pids still alive after the timeout."""
    return _wait_gone
