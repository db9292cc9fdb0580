"""Rewards scored in worker processes, each holding the reward's models once, fed each group as it
finishes: the scoring overlaps the rest of the rollout and never takes the trainer's GIL.

Each worker is a spawned process (`reward_worker.run_reward_worker`) that builds the reward from
its `RewardSpec`s (a model's device comes from its settings, e.g. `device: cuda:1`), with one
thread here that hands it groups from a shared queue, so a free worker takes the next group. A
group goes over a pipe as safetensors bytes (`reward_wire`), nothing pickled but the specs at start.

A worker that dies (killed, out of memory, a crash in native code) is seen at once: its thread
waits on the pipe and the process's sentinel together. The group it held, and every group still
queued, fail with `RewardWorkerDied`, which names the worker and its exit code, so the step stops
within moments instead of hanging; the thread starts a new worker for the next step. The scores
that come back are checked here too (`reward_checks`), as the trainer's own.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from trainers_adapters.composite_reward import RewardScores
from trainers_adapters.reward_checks import RewardError, checked_scores, samples
from trainers_adapters.reward_runner import RewardRunner, RewardsOnThreads
from trainers_adapters.reward_spec import RewardSpec, RewardValue, build_reward, reward_specs
from trainers_adapters.reward_wire import decode_scores, encode_group
from trainers_adapters.reward_worker import ERROR, READY, SCORES, run_reward_worker

logger = logging.getLogger(__name__)

_STOP_S = 30.0  # how long a worker may take to exit when told to, before it is killed


class RewardWorkerDied(RuntimeError):
    """A reward worker process ended while it held a group (or before it was ready)."""


@dataclass
class _Job:
    payload: bytes
    metadata: list[dict]
    future: Future = field(default_factory=Future)


class RewardWorkerPool(RewardRunner):
    """`num_workers` reward worker processes scoring `reward` (a recipe's `reward:` key, or its
    specs). Starting loads the models in every worker and waits until each is ready (or raises the
    worker's error). torch_threads: torch's intra-op threads in each worker (None: torch's default).
    Close it (or use it as a context manager): no process is left behind."""

    def __init__(
        self,
        reward: RewardValue | Sequence[RewardSpec],
        num_workers: int = 1,
        *,
        torch_threads: int | None = None,
        start_timeout_s: float = 600.0,
    ):
        if num_workers < 1:
            raise ValueError(f"a reward worker pool needs num_workers >= 1, got {num_workers}")
        self.specs = tuple(reward if _is_specs(reward) else reward_specs(reward))
        self.torch_threads = torch_threads
        self.start_timeout_s = start_timeout_s
        self._context = multiprocessing.get_context("spawn")  # fork would copy the trainer's CUDA state
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._workers = [_Worker(self, index) for index in range(num_workers)]
        try:
            for worker in self._workers:  # started together: the models load in parallel
                worker.spawn()
            for worker in self._workers:
                worker.wait_ready()
        except BaseException:
            for worker in self._workers:
                worker.stop()
            raise
        for worker in self._workers:
            worker.thread.start()

    @property
    def pids(self) -> list[int | None]:
        """The worker processes' ids, in worker order (None while one is being restarted)."""
        return [worker.pid for worker in self._workers]

    def submit(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> Future[RewardScores]:
        if self._closed:
            raise RuntimeError("this RewardWorkerPool is closed; make a new one")
        job = _Job(encode_group(images, prompts, metadata), list(metadata))
        self._jobs.put(job)
        return job.future

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_queued(RuntimeError("the reward worker pool was closed before this group was scored"))
        for _ in self._workers:  # after the failed groups: a worker finishes only the group it holds
            self._jobs.put(None)
        for worker in self._workers:
            worker.thread.join(_STOP_S + 5)
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


class _Worker:
    """One worker process and the thread here that feeds it."""

    def __init__(self, pool: RewardWorkerPool, index: int):
        self.pool = pool
        self.index = index
        self.process = None
        self.conn = None
        self.thread = threading.Thread(target=self._serve, name=f"reward-worker-{index}", daemon=True)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def spawn(self) -> None:
        context = self.pool._context
        conn, child = context.Pipe(duplex=True)
        process = context.Process(
            target=run_reward_worker,
            args=(self.pool.specs, child, self.index, self.pool.torch_threads),
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
                logger.info("reward worker %d ready (pid %d)", self.index, self.process.pid)
                return
            if message.startswith(ERROR):
                raise _remote_error(f"reward worker {self.index} could not build the reward", message)
        if not ready:
            raise TimeoutError(
                f"reward worker {self.index} did not load its reward within {self.pool.start_timeout_s} s "
                "(start_timeout_s)"
            )
        self.process.join(1.0)
        raise RewardWorkerDied(f"reward worker {self.index} {_ended(self.process)} while loading its reward")

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
            self.process.kill()
            self.process.join(_STOP_S)
        self.conn.close()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.spawn()
        self.wait_ready()

    def _serve(self) -> None:
        while True:
            job = self.pool._jobs.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                if self.process is None or not self.process.is_alive():  # died between steps
                    logger.warning("reward worker %d was gone; starting a new one", self.index)
                    self.restart()
                job.future.set_result(self._score(job))
            except RewardWorkerDied as error:
                job.future.set_exception(error)
                self.pool._fail_queued(RewardWorkerDied(f"{error} (this group was queued in the same step)"))
                self._restart_for_the_next_step()
            except BaseException as error:
                job.future.set_exception(error)

    def _score(self, job: _Job) -> RewardScores:
        try:
            self.conn.send_bytes(job.payload)
            ready = wait([self.conn, self.process.sentinel])
            message = self.conn.recv_bytes() if self.conn in ready else None
        except (EOFError, OSError):
            message = None
        if message is None:  # the process ended: its sentinel fired, or the pipe broke
            self.process.join(1.0)
            raise RewardWorkerDied(
                f"reward worker {self.index} {_ended(self.process)} while scoring "
                f"{samples(range(len(job.metadata)), job.metadata)}; this step fails, and the pool starts a new "
                "worker for the next one"
            )
        if message.startswith(ERROR):
            raise _remote_error(f"reward worker {self.index}", message)
        if not message.startswith(SCORES):
            raise RuntimeError(f"reward worker {self.index} answered {message[:1]!r}, not scores")
        scores = decode_scores(message[len(SCORES) :])
        # Checked here as well: what reaches the update is what this process has checked.
        components = {name: checked_scores(name, v, job.metadata) for name, v in scores.components.items()}
        total = checked_scores("the weighted sum of " + ", ".join(components), scores.total, job.metadata)
        return RewardScores(total=total, components=components)

    def _restart_for_the_next_step(self) -> None:
        if self.pool._closed:  # stopped by `close` while scoring: nothing comes next
            return
        try:
            self.restart()
        except Exception as error:  # tried again when the next group comes
            logger.error("reward worker %d could not be restarted: %s", self.index, error)


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


_ERRORS = {error.__name__: error for error in (RewardError, ValueError, TypeError)}


def _remote_error(where: str, message: bytes) -> Exception:
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


def open_reward_runner(reward: RewardValue, workers: int = 0) -> RewardRunner:
    """The runner of a recipe's `reward:` key: on a thread of this process (`workers` 0: the models
    load here), or in a pool of `workers` reward worker processes (each loads them)."""
    if workers < 0:
        raise ValueError(f"reward workers must be >= 0 (0: score on a thread of this process), got {workers}")
    if workers == 0:
        return RewardsOnThreads(build_reward(reward))
    return RewardWorkerPool(reward, num_workers=workers)
