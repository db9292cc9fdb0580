"""Errors the engine raises across the executor boundary."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker function raised. Carries the rank and the worker-side traceback."""

    def __init__(self, method: str, rank: int, error: str, remote_traceback: str):
        super().__init__(
            f"worker rank {rank} failed in {method!r}: {error}\n--- worker traceback ---\n{remote_traceback}"
        )
        self.method = method
        self.rank = rank
        self.error = error
        self.remote_traceback = remote_traceback


class EngineDeadError(RuntimeError):
    """A worker is gone; the engine cannot serve requests any more and must be rebuilt."""
