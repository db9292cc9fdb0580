"""The executor contract: how the engine reaches its workers, and the lifecycle every backend shares.

`execute` runs one engine step on every rank; `collective_rpc` runs any worker function on every
(or some) rank. Everything else the engine offers its users (weights, LoRA, sleep, checksums) is a
thin call over `collective_rpc`.

The `Executor` base class owns all of it but the transport: start-up (the worker bootstrap and the
ready handshake within `startup_timeout_s`), steps (ranks with no work get an empty
`RunnerOutput`), RPCs (method and rank resolution), timeouts and their wording, health, shutdown,
the dead state and the failure policy. A backend writes only how its calls travel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import cloudpickle
import torch

from executors import last_resort
from executors.bootstrap import WorkerBootstrap, worker_threads
from executors.replica_groups import GroupRendezvous, ReplicaLayout
from rollout.api import RolloutAPI, implements, ranks_list
from rollout.config import EngineConfig
from rollout.errors import EngineDeadError, WorkerError, interrupted_reason
from rollout.messages import RunnerOutput, SchedulerOutput
from rollout.weights.handed_over import HandedOver
from rollout.worker.marks import STAGES_WEIGHTS, mark_of, name_on_the_wire, worker_functions
from rollout.worker.worker import Worker, build_worker_class, call_function

logger = logging.getLogger(__name__)

# What a backend defines: its transport (see `Executor`).
TRANSPORT_METHODS = ("_start_workers", "_send_rpc", "_gather", "_release_workers")
# What an executor of an older contract wrote itself (`transport_problems`): the base's own steps,
# and the step's send of its own that a step through `_send_rpc` replaced (the base has none now).
_BASE_STEPS, _GONE_SENDS = ("_execute", "_collective_rpc"), ("_send_step",)
# An engine step's name on the wire and in messages: the worker's `@step` function.
STEP_NAME = Worker.execute.__name__
# The ready handshake's name, as messages about it show it.
STARTUP = "start-up"
MAX_RPC_TIMEOUT_S = 7 * 24 * 3600
# Reads of the workers' progress per `step_timeout_s` while a step runs past its first read: a
# hung step is declared within a tenth of the timeout after it, not a whole timeout later.
PROGRESS_READS = 10


class Executor:
    """Subclass this for a custom backend and write its transport, the methods under "The
    transport" below: `_start_workers`, `_send_rpc`, `_gather`, `_release_workers` and, where
    busy workers need it, `_stop_workers`. A step is a call like any other (`Worker.execute`,
    sent by name through `_send_rpc`, as vLLM's `execute_model` is a `collective_rpc`). Workers are instances of
    `self.worker_cls(config, rank)`, built where they run by `WorkerBootstrap.build(rank)`. A
    backend sets up what `_release_workers` frees before calling `super().__init__(config)`,
    which starts the workers (and releases them if start-up fails).

    Replica groups come with the base: with `ranks_per_replica` (`cfg_parallel` x
    `sequence_parallel`) > 1 a replica spans that many consecutive ranks
    (`executors.replica_groups`). `execute` takes and returns one part per replica and sends a
    replica's part to every rank of its group (one `_send_rpc` per replica). The
    bootstrap builds each worker with its place in its group, and the worker joins the group's
    process group; a transport need only start every rank (on Ray, a group's ranks on one node).
    `collective_rpc` addresses ranks, so every hot-swap call reaches every rank of every group.

    The contract every backend keeps: worker functions get their own copies of the tensors in
    their arguments (the caller may change or free its tensors right after the call), and calls
    to one worker run one at a time, between engine steps. A transport of one worker in this
    process sets `shares_memory`, and the base clones the tensors for it; other transports copy
    them across (or per rank, `copy_tensors`). Tensors in a `HandedOver` are the caller's no
    more: they reach the transport unwrapped, and the base does not clone them
    (`rollout.weights.handed_over`).

    The failure policy is here, once, for every backend:
    - a worker exception is a `WorkerError`; the workers live on;
    - a worker that is gone is an `EngineDeadError` (the transport raises it);
    - a step that makes no progress for `step_timeout_s`, or is interrupted (Ctrl-C), leaves the
      workers' state unknown: the workers are stopped and the executor is dead. A step that is
      merely slow is waited for: while its workers' models run, their progress counts grow, and
      the base reads them ten times per `step_timeout_s` and waits for as long as every replica
      still working moved less than `step_timeout_s` ago (`_gather_while_progressing`). Stopping
      the workers of a dead executor stops what they compute (`_stop_workers`: processes are
      killed; an in-process worker raises at its next unit of work);
    - an RPC that times out or is interrupted raises; the worker finishes it before its next call
      and its late reply is dropped;
    - once dead, every call fails fast with `EngineDeadError` and the reason.

    A transport that reports progress writes `_progress(ranks)`: rank -> its worker's
    `progress.count` (`rollout.worker.progress`: every unit of work of the worker's models adds one as
    it starts), read while the step runs, without waiting for it (`uni` reads the worker's count,
    `mp` a shared value each worker counts in, `ray` an actor method in a concurrency group of its
    own); and its `_gather` may be called again for the calls it did not answer, handing each
    answer once (a step's arguments stay readable until its answer comes). A backend without
    `_progress` (one written before it existed) keeps a whole-step deadline: a step must answer
    within `step_timeout_s` in all.

    The older contracts (workers started in the executor's own `__init__`, `_execute` and
    `_collective_rpc` written by the backend, its own `check_health` and `shutdown`; later a
    `_send_step` of its own for steps) are gone; such an executor is refused before any worker
    starts (`transport_problems`). To move one, start the workers in `_start_workers`, split
    `_execute` and `_collective_rpc` into the sends and `_gather` (return what answered; the base
    words the timeout and picks the failing rank), move what `shutdown` freed into
    `_release_workers`, and drop `check_health` and `shutdown`; a `_send_step` goes: its step
    reaches `_send_rpc` as `execute` by name, with `step=True`.
    """

    # One worker, in this process (`uni`): the base clones the tensors of its arguments for it. An
    # in-process transport of several workers leaves this False and gives each its own copies
    # (`copy_tensors`), as one clone shared by every rank would not be any rank's own.
    shares_memory = False
    # What the waits of steps and calls are timed with (a test of the failure policy sets a fake one).
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, config: EngineConfig):
        last_resort.install()  # the engine's warnings carry a format in a script without logging set up
        self.config = config
        self.num_workers = config.num_workers  # ranks: replicas x ranks per replica
        self.layout = ReplicaLayout.of(config)
        self.threads_per_worker = worker_threads(config)  # for backends whose workers run elsewhere
        self.worker_cls = build_worker_class(config.worker_extension_cls)
        self.pids: list[int] = []  # of the workers, in rank order, once started
        self._dead: str | None = None  # why the workers can no longer be used
        self._released = False
        self.rendezvous: GroupRendezvous | None = None  # made at start-up for groups of several ranks
        problems = transport_problems(type(self))
        if problems:
            raise TypeError("; ".join(problems))
        self._start()

    @classmethod
    def config_problems(cls, config: EngineConfig) -> list[str]:
        """What this backend finds wrong with `config`, each a message naming the setting and the
        fix; the engine reports them (`rollout.engine.config_check`) before any worker starts. Override it
        to add a backend's rules."""
        return []

    # What the engine calls.

    @property
    def num_replicas(self) -> int:
        return self.layout.num_replicas

    def execute(self, scheduler_output: SchedulerOutput) -> list[RunnerOutput]:
        """Run one engine step (`worker_inputs` by replica); one `RunnerOutput` per replica, in
        replica order: its group's leader's (a replica of one rank is that rank)."""
        self._check_alive()
        try:
            return self._execute(scheduler_output, self.config.step_timeout_s)
        except WorkerError:
            raise
        except EngineDeadError as error:
            self._die(str(error))
        except TimeoutError as error:
            # A step still running in a worker cannot be trusted or waited for.
            self._die(f"{error}; create a new engine (raise step_timeout_s if steps are that slow)")
        except BaseException as error:
            self.kill(interrupted_reason(error))
            raise

    @implements(RolloutAPI.collective_rpc)
    def collective_rpc(self, method, args, kwargs, timeout, ranks) -> list[Any]:
        """Call `method` on the addressed ranks (all when None); results in rank order. `timeout`:
        seconds in (0, MAX_RPC_TIMEOUT_S], or None for the config's `rpc_timeout_s`."""
        if timeout is not None and not (isinstance(timeout, int | float) and 0 < timeout <= MAX_RPC_TIMEOUT_S):
            # NaN fails the comparison too; a huge one overflowed the waits below (an HTTP client got a 500)
            raise ValueError(
                f"collective_rpc timeout must be a number of seconds in (0, {MAX_RPC_TIMEOUT_S}] (a week), "
                f"or None for rpc_timeout_s; got {timeout!r}"
            )
        self._check_alive()
        name, function = self.resolve_method(method)
        ranks = self.resolve_ranks(ranks)
        timeout = self.config.rpc_timeout_s if timeout is None else timeout
        args, kwargs = worker_arguments((tuple(args), dict(kwargs or {})), copy=self.shares_memory)
        # A worker function (by name or by reference) travels as its name; any other callable whole.
        sent = function if name_on_the_wire(self.worker_cls, method) is None else name
        try:
            return self._collective_rpc(name, sent, args, kwargs, timeout, ranks)
        except EngineDeadError as error:
            self._die(str(error))

    def check_health(self) -> None:
        """Raise if any worker cannot serve."""
        self.collective_rpc(Worker.check_health)

    def shutdown(self) -> None:
        """Stop every worker and free their resources. Idempotent."""
        if self._dead is None:
            self._dead = "the executor is shut down"
        self._release_once()

    @property
    def dead(self) -> str | None:
        """Why the workers can no longer be used (shut down, gone, interrupted); None while they can."""
        return self._dead

    def kill(self, reason: str) -> None:
        """Mark the executor dead with `reason` and stop the workers at once (no-op once dead)."""
        self._die(reason, False)

    # The transport: what a backend writes (see the class docstring).

    def _start_workers(self, bootstrap: WorkerBootstrap) -> dict[int, Any]:
        """Start one worker per rank, each built by `bootstrap.build(rank)` (or, in-process, as
        `self.worker_cls(self.config, rank)`); rank -> a pending call answering its pid once built."""
        raise NotImplementedError

    def _send_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, ranks: list[int], step: bool = False
    ) -> dict:
        """Send every rank in `ranks` the call `method(worker, *args, **kwargs)` (`method`: a worker
        function's name, which the worker looks up on its class, or any other callable; `name` is
        for messages), run as every worker function is (`rollout.worker.worker.call_function`);
        rank -> pending call. `step`: one replica's part of an engine step (`execute` by name,
        with its `WorkerInput`): the other replicas' parts are in flight beside it, each with
        arguments of its own, and the base may gather it again while it progresses, so its
        arguments must stay readable until it answers (only `mp`, whose RPCs share one reused
        argument block, does anything with it)."""
        raise NotImplementedError

    def _gather(self, name: str, pending: dict[int, Any], timeout: float) -> dict[int, Any]:
        """Wait at most `timeout` seconds for `pending` (rank -> call in flight); rank -> its result,
        or the `WorkerError` it raised, for each rank that answered in time (the base names the
        others in its TimeoutError). Raise EngineDeadError when a worker is gone. A call left
        unanswered must never hand its late answer to a later call. Where the transport reports
        `_progress`, the base may gather a step's unanswered calls again (the same handles)."""
        raise NotImplementedError

    def _progress(self, ranks: list[int]) -> Mapping[int, int] | None:
        """How far each of `ranks` has computed while a step runs: rank -> its worker's
        `progress.count` (`rollout.worker.progress`: it grows as the worker's models run), read without
        waiting for the step; a rank whose count cannot be read now may be left out (it counts as
        not moving). The base reads it as it sends a step and after each wait that expires, so it
        must be cheap, or read lazily (a Mapping that waits for its reads when first looked at, as
        `ray`'s does). None, the default: this transport reports no progress, and a step must answer
        within `step_timeout_s` in all. A transport that reports progress lets `_gather` wait
        again for the calls it did not answer (the base does while a step progresses)."""
        return None

    def _release_workers(self) -> None:
        """Stop the workers and free what they hold (processes, actors, shared memory). Called once:
        at shutdown, when the executor dies (after `_stop_workers`) or when start-up fails; it
        must cope with workers that are already gone or were never started."""

    def _stop_workers(self) -> None:
        """Make the workers stop at once, whatever they are doing (the executor is dead); the base
        calls `_release_workers` right after. Nothing to do where the release does not wait."""

    # The base's own steps over the transport.

    def _execute(self, scheduler_output: SchedulerOutput, timeout: float) -> list[RunnerOutput]:
        """Send each replica with work its part of the step, the same to every rank of its group;
        one `RunnerOutput` per replica, in replica order: its leader's (an empty one for a replica
        with nothing to do). The other ranks of a group answer once their step is done."""
        work = {replica: w for replica, w in scheduler_output.worker_inputs.items() if not w.is_empty}
        pending = {}
        for replica, w in work.items():
            pending |= self._send_rpc(STEP_NAME, STEP_NAME, (w,), {}, self.layout.ranks_of(replica), step=True)
        results = self._answers(STEP_NAME, pending, timeout, while_progressing=True)
        for replica in work:
            self._check_in_step(replica, results)
        return [results.get(self.layout.leader_of(replica), RunnerOutput()) for replica in range(self.num_replicas)]

    def _check_in_step(self, replica: int, results: dict[int, RunnerOutput]) -> None:
        """A follower that dropped a request its leader kept (it failed to start there alone) would
        step a batch of another size next: the group is out of step, and the engine stops. (The
        leader's failures include its decodes, which a follower does not run, so only this way round
        is a sign.)"""
        leader, *followers = self.layout.ranks_of(replica)
        for rank in followers:
            extra = sorted(set(results[rank].failed) - set(results[leader].failed))
            if extra:
                raise EngineDeadError(
                    f"worker rank {rank} of replica group {replica} failed requests {extra} that its leader "
                    f"(rank {leader}) did not: {results[rank].failed[extra[0]]}; the group's ranks are out of "
                    "step, so the engine stops: create a new engine"
                )

    def _collective_rpc(
        self, name: str, method: str | Callable, args: tuple, kwargs: dict, timeout: float, ranks: list[int]
    ) -> list[Any]:
        """Call `method` on `ranks` (checked by `collective_rpc`); results in rank order."""
        results = self._answers(name, self._send_rpc(name, method, args, kwargs, ranks), timeout)
        return [results[rank] for rank in ranks]

    def _answers(
        self, name: str, pending: dict[int, Any], timeout: float, while_progressing: bool = False
    ) -> dict[int, Any]:
        """rank -> result of every pending call. Raises EngineDeadError where a rank of a replica
        group failed a step (`group_step_failed`), else TimeoutError naming the ranks that did not
        answer, or else the `WorkerError` of the lowest rank that failed. `while_progressing`: the
        calls may take longer than `timeout` in all while their workers progress (a step)."""
        start = self.clock()
        if while_progressing:
            answers, progressed = self._gather_while_progressing(name, pending, timeout)
        else:
            answers, progressed = self._gather(name, pending, timeout), False
        broken = self.group_step_failed(name, answers)
        if broken is not None:
            group = self.layout.replica_of(broken.rank)
            raise EngineDeadError(
                f"worker rank {broken.rank} of replica group {group} failed a step: {broken.error}; the group's "
                "ranks are out of step (the others may wait for it in a collective), so the engine stops: "
                f"create a new engine\n--- worker traceback ---\n{broken.remote_traceback}"
            )
        late = sorted(set(pending) - set(answers))
        if late:
            since = f" (no progress in their last {timeout}s of {self.clock() - start:.1f}s)" if progressed else ""
            raise TimeoutError(
                f"worker call {name!r} timed out after {timeout}s; ranks that did not answer: {late}{since}"
            )
        for rank in sorted(answers):
            if isinstance(answers[rank], WorkerError):
                raise answers[rank]
        return answers

    def _gather_while_progressing(self, name: str, pending: dict[int, Any], timeout: float) -> tuple[dict, bool]:
        """`_gather` `pending` (a step's calls) for as long as every replica with a rank still
        computing progresses: one of its ranks' counts moved (the others may wait for it in a
        collective) less than `timeout` ago. The counts are read every `timeout / PROGRESS_READS`,
        and a move counts from the read that saw it, so a replica is hung between `timeout` and
        `timeout * (1 + 1 / PROGRESS_READS)` after its last unit of work started: a wait that saw
        the last units of a step start is no reason to wait a whole `timeout` more. Returns (rank
        -> answer, whether any replica progressed). A transport without progress gets one wait:
        `timeout` bounds the step in all."""
        sent = self.clock()
        counts = self._progress(sorted(pending))
        if counts is None:
            return self._gather(name, pending, timeout), False
        last_move = dict.fromkeys(self._by_replica(pending), sent)
        answers: dict[int, Any] = {}
        while True:
            waiting = {rank: call for rank, call in pending.items() if rank not in answers}
            deadline = min(last_move[replica] for replica in self._by_replica(waiting)) + timeout
            wait = min(max(deadline - self.clock(), 0.0), timeout / PROGRESS_READS)
            answers |= self._gather(name, waiting, wait)
            if len(answers) == len(pending) or self.group_step_failed(name, answers) is not None:
                break
            waiting = {rank: call for rank, call in pending.items() if rank not in answers}
            now = self._progress(sorted(waiting))
            read_at = self.clock()
            for replica, ranks in self._by_replica(waiting).items():
                if any(rank in now and rank in counts and now[rank] != counts[rank] for rank in ranks):
                    last_move[replica] = read_at
            counts = {**counts, **now}  # a rank left out of a read keeps its last count (no sign of progress)
            if any(read_at - last_move[replica] >= timeout for replica in self._by_replica(waiting)):
                break  # a replica made no progress in `timeout`: hung (the base names its ranks)
        return answers, any(moved > sent for moved in last_move.values())

    def _by_replica(self, ranks: Iterable[int]) -> dict[int, list[int]]:
        """replica -> its ranks among `ranks`, sorted."""
        grouped: dict[int, list[int]] = {}
        for rank in sorted(ranks):
            grouped.setdefault(self.layout.replica_of(rank), []).append(rank)
        return grouped

    def _start(self) -> None:
        """Start the workers and wait for every one's ready answer within startup_timeout_s; one
        that fails, dies or is late fails the start, and every worker is released."""
        timeout = self.config.startup_timeout_s
        try:
            self.rendezvous = GroupRendezvous.make(self.config)
            bootstrap = WorkerBootstrap.of(self.config, self.rendezvous)
            answers = self._gather(STARTUP, self._start_workers(bootstrap), timeout)
            late = [rank for rank in range(self.num_workers) if rank not in answers]
            if late:
                raise RuntimeError(f"worker ranks {late} did not start within {timeout}s")
            failed = [answer for _, answer in sorted(answers.items()) if isinstance(answer, WorkerError)]
            if failed:
                raise RuntimeError(
                    f"worker rank {failed[0].rank} failed to start: {failed[0].error}\n"
                    f"--- worker traceback ---\n{failed[0].remote_traceback}"
                )
        except EngineDeadError as error:
            self._release_once()
            raise RuntimeError(str(error)) from None
        except BaseException:
            self._release_once()
            raise
        self.pids = [answers[rank] for rank in range(self.num_workers)]
        logger.info(
            "%s started %d workers %s (%d replicas of %d ranks)",
            type(self).__name__,
            self.num_workers,
            self.pids,
            self.num_replicas,
            self.layout.ranks_per_replica,
        )

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _die(self, reason: str, raise_error: bool = True) -> None:
        """Mark the executor dead, stop the workers and (unless told not to) raise EngineDeadError."""
        if self._dead is None:
            self._dead = reason
            logger.error("engine is dead: %s", reason)
            try:
                self._stop_workers()
            finally:
                self._release_once()
        if raise_error:
            raise EngineDeadError(self._dead)

    def _release_once(self) -> None:
        if not self._released:
            self._released = True
            try:
                self._release_workers()
            finally:
                if self.rendezvous is not None:
                    self.rendezvous.remove()

    # Helpers for subclasses.

    def group_step_failed(self, name: str, answers: dict[int, Any]) -> WorkerError | None:
        """The error of the lowest rank of a replica group of several ranks that failed a step, if
        any. A worker raises out of a step only where its group did not fail with it (it does not
        isolate requests then: `rollout.parallel.group_failures`), and its peers may wait in a collective
        until their timeout: a transport's `_gather` stops waiting as soon as this answers one
        (one that waits on is slower, not wrong)."""
        if name != STEP_NAME or self.layout.ranks_per_replica == 1:
            return None
        failed = [rank for rank, answer in answers.items() if isinstance(answer, WorkerError)]
        return answers[min(failed)] if failed else None

    def resolve_method(self, method: str | Callable) -> tuple[str, Callable]:
        """(name for messages, function taking the worker first) for a worker function's name, a
        reference to one (`Worker.sleep`, a method of the extension: named as by its name), or any
        other callable. A `@stages_weights` function is refused: called alone it would apply nothing."""
        name = name_on_the_wire(self.worker_cls, method)
        if isinstance(method, str):
            available = worker_functions(self.worker_cls)
            if method not in available:
                raise ValueError(
                    f"unknown worker method {method!r}; available: {sorted(available)} "
                    "(add your own with EngineConfig(worker_extension_cls=...) or pass a callable)"
                )
            function = getattr(self.worker_cls, method)
        elif name is not None:
            function = method
        elif callable(method):
            name, function = getattr(method, "__qualname__", repr(method)), method
        else:
            raise TypeError(f"collective_rpc method must be a worker method name or a callable, got {method!r}")
        if mark_of(function) == STAGES_WEIGHTS:
            raise ValueError(
                f"worker function {name!r} stages weights, and collective_rpc would apply none of them: call "
                f"update_weights_from_worker({name!r}, ...), which applies them on every rank or on none, with a "
                "new weight version"
            )
        return name, function

    def resolve_ranks(self, ranks: Sequence[int] | None) -> list[int]:
        """The ranks a call addresses, sorted: all for None, else `ranks` (distinct ranks of this
        executor; `rollout.api.ranks_list` says what else is refused)."""
        ranks = ranks_list(ranks)
        if ranks is None:
            return list(range(self.num_workers))
        bad = [r for r in ranks if not 0 <= r < self.num_workers]
        if bad or not ranks:
            raise ValueError(f"ranks must be a non-empty subset of 0..{self.num_workers - 1}, got {ranks}")
        return sorted(ranks)


def transport_problems(cls: type[Executor]) -> list[str]:
    """What keeps `cls` from running under the base: the transport methods it does not define, and
    the base's own steps it writes itself (the older contract, whose steps bypass the failure
    policy and the progress waits)."""
    problems = []
    missing = [name for name in TRANSPORT_METHODS if getattr(cls, name) is getattr(Executor, name)]
    if missing:
        problems.append(
            f"executor {cls.__qualname__} does not define its transport: {', '.join(missing)} missing "
            "(see executors.base.Executor)"
        )
    own_steps = [name for name in _BASE_STEPS if getattr(cls, name) is not getattr(Executor, name)]
    own_steps += [name for name in _GONE_SENDS if any(name in vars(klass) for klass in cls.__mro__)]
    if own_steps:
        problems.append(
            f"executor {cls.__qualname__} writes {' and '.join(own_steps)}, the older executor contract, which is "
            "gone: write the transport instead (executors.base.Executor's docstring says how to move)"
        )
    return problems


def method_to_wire(method: str | Callable) -> str | bytes:
    """What crosses a process boundary for `collective_rpc`'s method: the name, or the callable
    serialised with cloudpickle (so lambdas and closures work)."""
    return method if isinstance(method, str) else cloudpickle.dumps(method)


def call_wire_method(worker, method: str | bytes, args: Sequence, kwargs: dict) -> Any:
    """Run a method received through `method_to_wire` on `worker` (in the worker's process)."""
    fn = cloudpickle.loads(method) if isinstance(method, bytes) else getattr(type(worker), method)
    return call_function(worker, fn, args, kwargs)


def map_nested(value: Any, kind: type | tuple[type, ...], fn: Callable[[Any], Any]) -> Any:
    """`value` with every instance of `kind` in it (directly, or inside lists, tuples and dict
    values) replaced by `fn(instance)`."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(map_nested(item, kind, fn) for item in value)
    if isinstance(value, dict):
        return {key: map_nested(item, kind, fn) for key, item in value.items()}
    return value


def copy_tensors(value: Any) -> Any:
    """`value` with every tensor in it (directly, or inside lists, tuples and dicts) cloned."""
    return map_nested(value, torch.Tensor, lambda tensor: tensor.detach().clone())


def worker_arguments(value: Any, copy: bool) -> Any:
    """`value` as worker functions get it: every `HandedOver` in it (directly, or inside lists,
    tuples and dicts) unwrapped, and with `copy` every other tensor cloned."""

    def private(item: HandedOver | torch.Tensor) -> Any:
        if isinstance(item, HandedOver):
            return item.value
        return item.detach().clone() if copy else item

    return map_nested(value, (HandedOver, torch.Tensor), private)
