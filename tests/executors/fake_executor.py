"""A scripted executor: the real `Executor` base class over a fake transport whose outcomes a test
sets, so the failure policy runs in milliseconds, with no process, model or clock.

    executor = ScriptedExecutor(config)  # or EngineConfig(executor=ScriptedExecutor) for an engine
    executor.script("execute", Hangs(), ranks=[1])  # rank 1 never answers a step
    executor.script("get_rank", Answer(7), Raises(EngineDeadError("gone")))  # the first call, then all later ones
    executor.script("execute", Slow(3), ranks=[0])  # rank 0 answers a step in the third wait for it

An unscripted call runs on the rank's `FakeWorker` (a method by name, or `fn(worker, ...)`), as a
real worker would run it. Timeouts are not waited for: a rank that `Hangs` is simply missing from
what `_gather` returns, which is what a real transport returns once the deadline passes, and the
executor's clock (`now`, fake seconds) moves on by the wait's timeout.
`ProgressingExecutor` adds a transport's progress reads, scripted the same way.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from executors.base import STARTUP, Executor
from executors.bootstrap import WorkerBootstrap
from rollout.config import EngineConfig
from rollout.errors import WorkerError
from rollout.messages import RunnerOutput, WorkerInput
from rollout.model_spec import ModelSpec
from rollout.worker.work_profile import WorkProfile, measure_work

# What a tiny SD3 reports, so an engine can check requests against it.
FAKE_SPEC = ModelSpec(
    pipeline_class="StableDiffusion3Pipeline",
    latent_channels=4,
    vae_scale_factor=8,
    patch_size=2,
    latent_packing=1,
    default_height=32,
    default_width=32,
    default_max_sequence_length=256,
    max_sequence_length_limit=512,
    guidance_defaults={"guidance_scale": 4.5},
    cfg_field="guidance_scale",
    default_negative_prompt="",
)


# A model with no work to speak of: admission by work refuses nothing.
FAKE_WORK = WorkProfile(
    units=(), attention_flops_per_s=1e9, other_flops_per_s=1e9, latent_frames=1, cfg_in_one_pass=False, device="cpu"
)


@dataclass(frozen=True)
class Answer:
    """The rank answers `value`."""

    value: Any


@dataclass(frozen=True)
class Fails:
    """The worker function raised `error`: the rank answers with a `WorkerError`."""

    error: Exception


@dataclass(frozen=True)
class Raises:
    """The transport itself raises `error`, while waiting for the rank or (`on_send`) while sending
    to it: EngineDeadError (the worker is gone), TimeoutError, KeyboardInterrupt, ..."""

    error: BaseException
    on_send: bool = False


@dataclass(frozen=True)
class Hangs:
    """The rank does not answer before the deadline."""


@dataclass(frozen=True)
class Slow:
    """The rank answers (runs the call) in the `waits`-th wait for it, and is missing from the
    waits before (each a deadline that passed)."""

    waits: int


Outcome = Answer | Fails | Raises | Hangs | Slow


class FakeWorker:
    """What an unscripted call runs on: a worker without a model."""

    def __init__(self, rank: int):
        self.rank = rank
        self.steps: list[WorkerInput] = []

    def execute(self, work: WorkerInput) -> RunnerOutput:
        self.steps.append(work)
        return RunnerOutput()

    def model_spec(self) -> ModelSpec:
        return FAKE_SPEC

    def check_health(self) -> bool:
        return True

    def get_rank(self) -> int:
        return self.rank

    def request_ids(self) -> list[str]:
        return []


@dataclass(frozen=True)
class FakeCall:
    """A call in flight: what `_gather` will answer for it."""

    call_id: int
    name: str
    rank: int
    outcome: Outcome | None  # None: run `run` on the worker
    run: Callable[[], Any]


@dataclass
class TransportLog:
    """What the base asked the transport to do, for tests to assert on."""

    sent: list[tuple[str, int]] = field(default_factory=list)  # (call name, rank), in order
    gathered: list[tuple[str, float, list[int]]] = field(default_factory=list)  # (name, timeout, call ids)
    stopped: int = 0
    released: int = 0
    progress_reads: list[list[int]] = field(default_factory=list)  # the ranks of each progress read


class ScriptedExecutor(Executor):
    """The `Executor` base class over a scripted transport; `script` sets outcomes by call name
    (a worker method name, a callable's qualified name, "execute", or `executors.base.STARTUP`)."""

    def __init__(self, config: EngineConfig, before_start: Callable[[ScriptedExecutor], None] | None = None):
        """`before_start(executor)` scripts the start-up (the base starts the workers in `__init__`)."""
        self.log = TransportLog()
        self.workers: dict[int, FakeWorker] = {}
        self._scripts: dict[tuple[str, int], list[Outcome]] = {}
        self._call_ids = itertools.count()
        self._waits: dict[int, int] = {}  # call id -> waits for it so far (`Slow`)
        self._num_ranks = config.num_workers  # script() may run before the base sets num_workers
        self.now = 0.0  # the fake clock the base times its waits with
        # What an engine asks every worker as it starts (`rollout.worker.work_profile.measure_work`).
        self.script(measure_work.__qualname__, Answer(FAKE_WORK))
        if before_start is not None:
            before_start(self)
        super().__init__(config)

    def clock(self) -> float:
        return self.now

    def script(self, name: str, *outcomes: Outcome, ranks: list[int] | None = None) -> None:
        """The next calls `name` on `ranks` (all when None) have these outcomes, one per call; the
        last one stays for every later call."""
        for rank in range(self._num_ranks) if ranks is None else ranks:
            self._scripts[(name, rank)] = list(outcomes)

    # The transport.

    def _start_workers(self, bootstrap: WorkerBootstrap) -> dict[int, FakeCall]:
        return {
            rank: self._send(STARTUP, rank, lambda rank=rank: self._build(rank)) for rank in range(self.num_workers)
        }

    def _send_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, ranks: list[int], step: bool = False
    ) -> dict:
        def run(rank: int) -> Any:
            worker = self.workers[rank]
            fn = (
                getattr(type(worker), method) if isinstance(method, str) else method
            )  # as a worker process resolves it
            return fn(worker, *args, **kwargs)

        return {rank: self._send(name, rank, lambda rank=rank: run(rank)) for rank in ranks}

    def _gather(self, name: str, pending: dict[int, FakeCall], timeout: float) -> dict[int, Any]:
        self.log.gathered.append((name, timeout, [call.call_id for call in pending.values()]))
        answers = {}
        for rank, call in sorted(pending.items()):
            outcome = call.outcome
            if isinstance(outcome, Raises):
                raise outcome.error
            if isinstance(outcome, Hangs):
                continue
            if isinstance(outcome, Slow):
                self._waits[call.call_id] = self._waits.get(call.call_id, 0) + 1
                if self._waits[call.call_id] < outcome.waits:
                    continue
                outcome = None
            if isinstance(outcome, Answer):
                answers[rank] = outcome.value
                continue
            try:
                if isinstance(outcome, Fails):
                    raise outcome.error
                answers[rank] = call.run()
            except Exception as error:
                answers[rank] = WorkerError(
                    call.name, rank, WorkerError.type_path(error), str(error), "(fake traceback)"
                )
        if len(answers) < len(pending):  # a real transport returns once the deadline passed
            self.now += timeout
        return answers

    def _stop_workers(self) -> None:
        self.log.stopped += 1

    def _release_workers(self) -> None:
        self.log.released += 1
        self.workers.clear()

    # Internals.

    def _send(self, name: str, rank: int, run: Callable[[], Any]) -> FakeCall:
        self.log.sent.append((name, rank))
        outcome = self._next_outcome(name, rank)
        if isinstance(outcome, Raises) and outcome.on_send:
            raise outcome.error
        return FakeCall(next(self._call_ids), name, rank, outcome, run)

    def _next_outcome(self, name: str, rank: int) -> Outcome | None:
        outcomes = self._scripts.get((name, rank))
        if not outcomes:
            return None
        return outcomes.pop(0) if len(outcomes) > 1 else outcomes[0]

    def _build(self, rank: int) -> int:
        self.workers[rank] = FakeWorker(rank)
        return os.getpid()


class ProgressingExecutor(ScriptedExecutor):
    """A scripted executor whose transport reports progress (`_progress`): `counts[rank]` lists
    what the reads of that rank's count answer, in turn, the last one for every later read; a rank
    without counts reads 0 every time (it never progresses)."""

    def __init__(self, config: EngineConfig, before_start: Callable[[ScriptedExecutor], None] | None = None):
        self.counts: dict[int, list[int]] = {}
        super().__init__(config, before_start)

    def _progress(self, ranks: list[int]) -> dict[int, int]:
        self.log.progress_reads.append(list(ranks))
        counts = {}
        for rank in ranks:
            listed = self.counts.get(rank, [0])
            counts[rank] = listed.pop(0) if len(listed) > 1 else listed[0]
        return counts
