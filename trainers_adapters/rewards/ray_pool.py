"""Rewards scored in Ray actors, one per reward worker, on a local Ray or across a cluster: each
actor builds the reward from its `RewardSpec`s once (on the GPU Ray gives it when its device is
"cuda"), and one thread here hands it the next finished group (`worker_queue`), as the
process pool does. A group travels as the same safetensors bytes (`wire`) through Ray.

It attaches to a running Ray when `ray.is_initialized()` or `RAY_ADDRESS` says there is one, and
otherwise starts a local one that `close` stops. An actor that dies (`ray.kill`, a lost node, a
crash) fails its group and the queued ones with `RewardWorkerDied`; one that holds a group past
the timeout is killed (`RewardWorkerTimeout`); either way a new actor serves the next step.
"""

from __future__ import annotations

import logging
import os

import torch

from trainers_adapters.rewards.worker import ERROR, READY, answer_group, build_on_device, error_message
from trainers_adapters.rewards.worker_queue import (
    Job,
    QueuedRewardPool,
    RewardWorker,
    RewardWorkerDied,
    remote_error,
)

logger = logging.getLogger(__name__)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(
            "reward_runner 'ray' needs Ray: pip install 'diffusion-rollout[ray]' (or pip install 'ray[default]')"
        ) from None
    return ray


def ray_device_problem(device: str) -> str | None:
    """Why a Ray actor cannot be placed on `device`, or None: Ray picks each actor's GPU itself."""
    if torch.device(device).type == "cuda" and torch.device(device).index is not None:
        return f"{device!r}: Ray gives each actor its GPU; write cuda (one GPU per actor) or cpu"
    return None


class RayRewardHost:
    """Runs inside a Ray actor: builds the reward once, then answers groups one at a time."""

    def __init__(self, specs, index: int, device: str | None, torch_threads: int | None):
        self.index = index
        try:
            self.reward = build_on_device(specs, device, torch_threads)
            self.ready_message = READY
        except Exception as error:  # answered by `ready`: a failed constructor would only say the actor died
            self.reward = None
            self.ready_message = ERROR + error_message(error)

    def ready(self) -> bytes:
        return self.ready_message

    def pid(self) -> int:
        return os.getpid()

    def score(self, payload: bytes) -> bytes:
        return answer_group(self.reward, payload)


class RayRewardPool(QueuedRewardPool):
    """`num_workers` Ray actors scoring `reward` (a recipe's `reward:` key, or its specs); devices:
    one per actor, "cpu" or "cuda" (one GPU per actor, which Ray picks; None: where the specs'
    settings say, on CPU resources); timeout_s: the longest one group may take in an actor before
    it is killed; torch_threads: torch's threads in each actor and the CPUs it asks Ray for (1 when
    None). Close it (or use it as a context manager): no actor is left behind."""

    def __init__(self, reward, num_workers: int = 1, **options):
        self._ray = import_ray()
        self._started_ray = False
        if not self._ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                self._ray.init(address=os.environ["RAY_ADDRESS"])
            else:
                self._ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
                self._started_ray = True
        self._actor_class = self._ray.remote(RayRewardHost)
        try:
            super().__init__(reward, num_workers, **options)
        except BaseException:
            self._stop_ray()
            raise

    def _new_worker(self, index: int, device: str | None) -> RewardWorker:
        problem = None if device is None else ray_device_problem(device)
        if problem is not None:
            raise ValueError(f"device {problem}")
        return _ActorWorker(self, index, device)

    @property
    def actors(self) -> list:
        """The actors' handles, in worker order (None while one is being restarted)."""
        return [worker.actor for worker in self._workers]

    @property
    def pids(self) -> list[int | None]:
        """The actors' process ids, in worker order."""
        return [worker.pid for worker in self._workers]

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._stop_ray()

    def _stop_ray(self) -> None:
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False


class _ActorWorker(RewardWorker):
    """One Ray actor holding the reward."""

    actor = None
    pid = None

    def start(self) -> None:
        pool = self.pool
        gpus = 1 if self.device is not None and torch.device(self.device).type == "cuda" else 0
        self.actor = pool._actor_class.options(num_cpus=pool.torch_threads or 1, num_gpus=gpus).remote(
            pool.specs, self.index, self.device, pool.torch_threads
        )
        self._ready = self.actor.ready.remote()

    def wait_ready(self) -> None:
        ray = self.pool._ray
        try:
            message = ray.get(self._ready, timeout=self.pool.start_timeout_s)
            self.pid = ray.get(self.actor.pid.remote(), timeout=self.pool.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"reward worker {self.index} (Ray actor) did not load its reward within {self.pool.start_timeout_s} "
                f"s (start_timeout_s); cluster resources: {ray.available_resources()}"
            ) from None
        except ray.exceptions.RayError as error:
            raise RewardWorkerDied(
                f"reward worker {self.index} (Ray actor) died while loading its reward: "
                f"{type(error).__name__}: {error}"
            ) from None
        if message != READY:
            raise remote_error(f"reward worker {self.index} could not build the reward", message)
        logger.info("reward worker %d ready (Ray actor, pid %d, device %s)", self.index, self.pid, self.device)

    def alive(self) -> bool:
        """Whether the actor answers (a round trip: it is idle when asked), so one that died
        between steps is replaced before it is given a group."""
        if self.actor is None:
            return False
        ray = self.pool._ray
        try:
            ray.get(self.actor.pid.remote(), timeout=self.pool.start_timeout_s)
        except ray.exceptions.RayError:
            return False
        return True

    def score(self, job: Job, timeout_s: float) -> bytes:
        ray = self.pool._ray
        who = f"reward worker {self.index} (Ray actor, pid {self.pid})"
        try:
            return ray.get(self.actor.score.remote(job.payload), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.stop()
            raise self.timed_out(job, timeout_s, who) from None
        except ray.exceptions.RayError as error:  # the actor died, its node was lost, Ray failed
            raise RewardWorkerDied(
                f"{who} died while scoring {job.samples()} ({type(error).__name__}); this step fails, and the pool "
                "starts a new actor for the next one"
            ) from None

    def stop(self) -> None:
        if self.actor is None:
            return
        self.pool._ray.kill(self.actor, no_restart=True)
        self.actor = self.pid = None
