"""Rewards scored in worker processes, each holding the reward's models once on its own device,
fed each group as it finishes: the scoring overlaps the rest of the rollout and never takes the
trainer's GIL.

Each worker is a spawned process (`worker.run_reward_worker`) that builds the reward from
its `RewardSpec`s on the device the pool gives it (or where the specs' settings say), with one
thread here that hands it groups from a shared queue (`worker_queue`). A group goes over a
pipe as safetensors bytes (`wire`), nothing pickled but the specs at start.

A worker that dies (killed, out of memory, a crash in native code) is seen at once: its thread
waits on the pipe and the process's sentinel together, so `RewardWorkerDied` names the worker and
its exit code; one that does not answer within the timeout is killed (`RewardWorkerTimeout`).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from multiprocessing.connection import wait

from trainers_adapters.rewards.worker import ERROR, READY, run_reward_worker
from trainers_adapters.rewards.worker_queue import (
    Job,
    QueuedRewardPool,
    RewardWorker,
    RewardWorkerDied,
    RewardWorkerTimeout,
    remote_error,
)

logger = logging.getLogger(__name__)

_STOP_S = 30.0  # how long a worker may take to exit when told to, before it is killed

__all__ = ["RewardWorkerDied", "RewardWorkerPool", "RewardWorkerTimeout"]


class RewardWorkerPool(QueuedRewardPool):
    """`num_workers` reward worker processes scoring `reward` (a recipe's `reward:` key, or its
    specs); devices: one per worker ("cpu", "cuda:1"), each worker's models built there (None:
    where the specs' settings say); timeout_s: the longest one group may take in a worker before
    the worker is killed; torch_threads: torch's intra-op threads in each worker (None: torch's
    default). Starting loads the models in every worker and waits until each is ready (or raises
    the worker's error). Close it (or use it as a context manager): no process is left behind."""

    def _new_worker(self, index: int, device: str | None) -> RewardWorker:
        return _ProcessWorker(self, index, device)

    @property
    def pids(self) -> list[int | None]:
        """The worker processes' ids, in worker order (None while one is being restarted)."""
        return [worker.pid for worker in self._workers]


class _ProcessWorker(RewardWorker):
    """One spawned worker process and the pipe to it."""

    process = None
    conn = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")  # fork would copy the trainer's CUDA state
        conn, child = context.Pipe(duplex=True)
        pool = self.pool
        process = context.Process(
            target=run_reward_worker,
            args=(pool.specs, child, self.index, self.device, pool.torch_threads),
            name=f"reward-worker-{self.index}",
            daemon=True,  # ends with the trainer, whatever happens to it
        )
        try:
            process.start()
        finally:
            child.close()
        self.conn, self.process = conn, process

    def wait_ready(self) -> None:
        ready = wait([self.conn, self.process.sentinel], self.pool.start_timeout_s)
        if self.conn in ready:
            try:
                message = self.conn.recv_bytes()
            except EOFError:
                message = b""
            if message == READY:
                logger.info("reward worker %d ready (pid %d, device %s)", self.index, self.process.pid, self.device)
                return
            if message.startswith(ERROR):
                raise remote_error(f"reward worker {self.index} could not build the reward", message)
        if not ready:
            raise TimeoutError(
                f"reward worker {self.index} did not load its reward within {self.pool.start_timeout_s} s "
                "(start_timeout_s)"
            )
        self.process.join(1.0)
        raise RewardWorkerDied(f"reward worker {self.index} {_ended(self.process)} while loading its reward")

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def score(self, job: Job, timeout_s: float) -> bytes:
        try:
            self.conn.send_bytes(job.payload)
            ready = wait([self.conn, self.process.sentinel], timeout_s)
            message = self.conn.recv_bytes() if self.conn in ready else None
        except (EOFError, OSError):
            ready, message = [self.process.sentinel], None
        if not ready:  # alive, but holding the group too long: a hung reward
            who = f"reward worker {self.index} (pid {self.process.pid})"
            self._kill()
            raise self.timed_out(job, timeout_s, who)
        if message is None:  # the process ended: its sentinel fired, or the pipe broke
            self.process.join(1.0)
            raise RewardWorkerDied(
                f"reward worker {self.index} {_ended(self.process)} while scoring {job.samples()}; this step fails, "
                "and the pool starts a new worker for the next one"
            )
        return message

    def stop(self) -> None:
        if self.process is None:
            return
        try:
            self.conn.send_bytes(b"")  # the worker's stop message
        except OSError:
            pass  # it is gone already
        self.process.join(_STOP_S)
        if self.process.is_alive():
            logger.warning("reward worker %d did not stop within %s s; killing it", self.index, _STOP_S)
            self._kill()
        self.conn.close()
        self.process = None

    def _kill(self) -> None:
        self.process.kill()
        self.process.join(_STOP_S)


def _ended(process) -> str:
    code = process.exitcode
    if code is None:
        return f"(pid {process.pid}) stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"(pid {process.pid}) died with exit code {code} (killed by {name})"
    return f"(pid {process.pid}) died with exit code {code}"
