"""What the reward worker pools share, whatever a worker is (a process: `RewardWorkerPool`; a Ray
actor: `RayRewardPool`): a queue of finished groups, one thread here per worker that hands it the
next group (so a free worker takes it), the failure policy, and the check of what comes back.

A worker that dies while it holds a group fails that group and every group still queued with
`RewardWorkerDied`, naming the worker, so the step stops within moments instead of hanging; a
worker that holds a group longer than `timeout_s` is killed and fails them the same way
(`RewardWorkerTimeout`). Either way the thread starts a new worker for the next step. The scores
that come back are checked here too (`checks`), as the trainer's own.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from trainers_adapters.rewards.checks import RewardError, checked_scores, samples
from trainers_adapters.rewards.composite import RewardScores
from trainers_adapters.rewards.runner import RewardRunner
from trainers_adapters.rewards.spec import RewardSpec, RewardValue, reward_specs
from trainers_adapters.rewards.wire import decode_scores, encode_group
from trainers_adapters.rewards.worker import ERROR, SCORES

logger = logging.getLogger(__name__)

# How long `close` lets a worker finish the group it holds before stopping it (a group longer
# than that fails: the pool is closing).
_CLOSE_WAIT_S = 35.0


class RewardWorkerDied(RuntimeError):
    """A reward worker ended (or was killed) while it held a group, or before it was ready."""


class RewardWorkerTimeout(RewardWorkerDied):
    """A reward worker held a group past the pool's timeout; it was killed (so, to the step, it died)."""


@dataclass
class Job:
    """One group to score: its wire bytes, its metadata (for messages and checks), its answer."""

    payload: bytes
    metadata: list[dict]
    future: Future = field(default_factory=Future)

    def samples(self) -> str:
        return samples(range(len(self.metadata)), self.metadata)


class RewardWorker:
    """One worker as the pool drives it; a transport implements each method. `score` raises
    `RewardWorkerDied` when the worker ends while scoring, `RewardWorkerTimeout` (after killing it)
    when it does not answer within `timeout_s`."""

    def __init__(self, pool: QueuedRewardPool, index: int, device: str | None):
        self.pool = pool
        self.index = index
        self.device = device

    def start(self) -> None:
        """Start the worker building its reward (without waiting for it)."""
        raise NotImplementedError

    def wait_ready(self) -> None:
        """Wait until the reward is built; raise its error, or RewardWorkerDied, or TimeoutError."""
        raise NotImplementedError

    def alive(self) -> bool:
        raise NotImplementedError

    def score(self, job: Job, timeout_s: float) -> bytes:
        """The worker's answer to `job` (SCORES + scores, or ERROR + its error)."""
        raise NotImplementedError

    def stop(self) -> None:
        """End the worker (killing it if it does not end in time); nothing once it is stopped."""
        raise NotImplementedError

    def restart(self) -> None:
        self.stop()
        self.start()
        self.wait_ready()

    def timed_out(self, job: Job, timeout_s: float, who: str) -> RewardWorkerTimeout:
        """The error of a worker (`who`) that held `job` past `timeout_s`, once it has been killed."""
        return RewardWorkerTimeout(
            f"{who} did not answer within {timeout_s:g} s (reward_timeout_s) while scoring {job.samples()} with "
            f"reward {self.pool.label}; it was killed, this step fails, and the pool starts a new worker for "
            "the next one"
        )


class QueuedRewardPool(RewardRunner):
    """`num_workers` workers scoring `reward` (a recipe's `reward:` key, or its specs), the
    subclass's kind of worker (`_new_worker`). devices: one per worker, where it builds the
    models (None: where each spec's settings say); timeout_s: the longest a worker may take over
    one group. Starting builds the reward in every worker and waits until each is ready (or
    raises the worker's error). Close it (or use it as a context manager): no worker is left."""

    def __init__(
        self,
        reward: RewardValue | Sequence[RewardSpec],
        num_workers: int = 1,
        *,
        devices: Sequence[str] | None = None,
        timeout_s: float = 600.0,
        torch_threads: int | None = None,
        start_timeout_s: float = 600.0,
    ):
        if num_workers < 1:
            raise ValueError(f"a reward worker pool needs num_workers >= 1, got {num_workers}")
        if devices is not None and len(devices) != num_workers:
            raise ValueError(
                f"devices names {len(devices)} devices for {num_workers} reward workers; give one per worker"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s (reward_timeout_s) must be > 0 seconds, got {timeout_s}")
        self.specs = tuple(reward if _is_specs(reward) else reward_specs(reward))
        if devices is not None:
            for spec in self.specs:  # refused here, before any worker starts, not in each worker
                spec.placed_on(devices[0])
        self.label = " + ".join(f"{spec.weight:g}*{spec.name}" for spec in self.specs)
        self.timeout_s = timeout_s
        self.torch_threads = torch_threads
        self.start_timeout_s = start_timeout_s
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closed = False
        self._workers = [
            self._new_worker(index, None if devices is None else devices[index]) for index in range(num_workers)
        ]
        self._threads = [
            threading.Thread(target=self._serve, args=(worker,), name=f"reward-worker-{worker.index}", daemon=True)
            for worker in self._workers
        ]
        try:
            for worker in self._workers:  # started together: the models load in parallel
                worker.start()
            for worker in self._workers:
                worker.wait_ready()
        except BaseException:
            self._stop_workers()
            raise
        for thread in self._threads:
            thread.start()

    def _new_worker(self, index: int, device: str | None) -> RewardWorker:
        raise NotImplementedError

    def submit(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> Future[RewardScores]:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; make a new one")
        job = Job(encode_group(images, prompts, metadata), list(metadata))
        self._jobs.put(job)
        return job.future

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_queued(RuntimeError("the reward worker pool was closed before this group was scored"))
        for _ in self._workers:  # after the failed groups: a worker finishes only the group it holds
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(_CLOSE_WAIT_S)
        self._stop_workers()

    def _stop_workers(self) -> None:
        for worker in self._workers:
            worker.stop()

    def _fail_queued(self, error: BaseException) -> None:
        """Fail every group still queued (they belong to the step that fails), keeping stop marks."""
        stops = 0
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                stops += 1
            elif job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
        for _ in range(stops):
            self._jobs.put(None)

    def _serve(self, worker: RewardWorker) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                if not worker.alive():  # died between steps
                    logger.warning("reward worker %d was gone; starting a new one", worker.index)
                    worker.restart()
                job.future.set_result(self._checked(worker, job, worker.score(job, self.timeout_s)))
            except RewardWorkerDied as error:
                job.future.set_exception(error)
                self._fail_queued(type(error)(f"{error} (this group was queued in the same step)"))
                self._restart_for_the_next_step(worker)
            except BaseException as error:
                job.future.set_exception(error)

    def _checked(self, worker: RewardWorker, job: Job, message: bytes) -> RewardScores:
        if message.startswith(ERROR):
            raise remote_error(f"reward worker {worker.index}", message)
        if not message.startswith(SCORES):
            raise RuntimeError(f"reward worker {worker.index} answered {message[:1]!r}, not scores")
        scores = decode_scores(message[len(SCORES) :])
        # Checked here as well: what reaches the update is what this process has checked.
        components = {name: checked_scores(name, v, job.metadata) for name, v in scores.components.items()}
        total = checked_scores("the weighted sum of " + ", ".join(components), scores.total, job.metadata)
        return RewardScores(total=total, components=components)

    def _restart_for_the_next_step(self, worker: RewardWorker) -> None:
        if self._closed:  # stopped by `close` while scoring: nothing comes next
            return
        try:
            worker.restart()
        except Exception as error:  # tried again when the next group comes
            logger.error("reward worker %d could not be restarted: %s", worker.index, error)


_ERRORS = {error.__name__: error for error in (RewardError, ValueError, TypeError)}


def remote_error(where: str, message: bytes) -> Exception:
    """The worker's error as the same class where it is one a caller catches (RewardError,
    ValueError, TypeError), else a RuntimeError; its traceback is logged."""
    error = json.loads(message[len(ERROR) :])
    logger.debug("%s raised:\n%s", where, error["traceback"])
    cls = _ERRORS.get(error["type"], RuntimeError)
    text = error["message"] if cls is not RuntimeError else f"{error['type']}: {error['message']}"
    return cls(f"{where}: {text}")


def _is_specs(reward) -> bool:
    return (
        isinstance(reward, Sequence)
        and not isinstance(reward, str)
        and all(isinstance(item, RewardSpec) for item in reward)
    )
