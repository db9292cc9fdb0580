"""The failure policy of the `Executor` base class, rule by rule, over a scripted transport
(tests/executors/fake_executor.py): what every backend inherits, in milliseconds. The same rules
on the real backends: test_failure_policy.py, test_mp_executor.py, test_ray_executor.py and the
contract suite."""

from __future__ import annotations

import json
import re

import pytest

from executors.base import PROGRESS_READS, STARTUP, Executor
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.errors import EngineDeadError, WorkerError
from rollout.messages import RunnerOutput, SchedulerOutput, WorkerInput
from tests.executors.fake_executor import Answer, Fails, Hangs, ProgressingExecutor, Raises, ScriptedExecutor, Slow

pytestmark = pytest.mark.timeout(30)

SHUT_DOWN = "the executor is shut down"
INTERRUPTED = "interrupted during an engine step (KeyboardInterrupt); create a new engine"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    """A folder that passes EngineConfig's check; nothing loads it (the workers are fakes)."""
    folder = tmp_path_factory.mktemp("no_model")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    return str(folder)


@pytest.fixture
def config(model_folder) -> EngineConfig:
    return EngineConfig(
        model=model_folder, executor=ScriptedExecutor, num_workers=3, step_timeout_s=5.0, rpc_timeout_s=2.0
    )


@pytest.fixture
def executor(config):
    executor = ScriptedExecutor(config)
    yield executor
    executor.shutdown()


def a_step(*busy_ranks: int) -> SchedulerOutput:
    return SchedulerOutput(
        {rank: WorkerInput(step_ids=[f"r{rank}"]) if rank in busy_ranks else WorkerInput() for rank in range(3)}
    )


def assert_dead_for_good(executor: ScriptedExecutor, reason: str) -> None:
    """Dead with `reason`: every call fails with it before reaching the transport; workers stopped once."""
    sent = len(executor.log.sent)
    for call in (
        lambda: executor.execute(a_step(0)),
        lambda: executor.collective_rpc("get_rank"),
        executor.check_health,
    ):
        with pytest.raises(EngineDeadError, match=re.escape(reason)):
            call()
    assert executor.dead == reason
    assert len(executor.log.sent) == sent
    assert executor.log.released == 1


# Start-up: the bootstrap and the ready handshake.


def test_start_up_waits_for_every_rank_within_the_startup_timeout(executor, config):
    assert executor.pids and len(executor.pids) == 3
    assert [name for name, _ in executor.log.sent] == [STARTUP] * 3
    assert executor.log.gathered[0][:2] == (STARTUP, config.startup_timeout_s)
    assert executor.threads_per_worker >= 1 and executor.dead is None


@pytest.mark.parametrize(
    "outcome, message",
    [
        (
            Fails(OSError("bad weights file")),
            r"(?s)worker rank 1 failed to start: OSError: bad weights file\n--- worker traceback ---",
        ),
        (Hangs(), r"worker ranks \[1\] did not start within 600.0s"),
        (
            Raises(EngineDeadError("worker rank 1 (pid 9) died (exit code 1) during 'start-up'")),
            r"worker rank 1 .* died",
        ),
    ],
)
def test_a_rank_that_fails_hangs_or_dies_at_start_up_fails_the_start_and_releases_all(config, outcome, message):
    started = []

    def script(executor):
        started.append(executor)
        executor.script(STARTUP, outcome, ranks=[1])

    with pytest.raises(RuntimeError, match=message) as error:
        ScriptedExecutor(config, before_start=script)
    assert not isinstance(error.value, EngineDeadError)  # a start that failed, not an engine that died
    assert started[0].log.released == 1


# Steps and RPCs that go well.


def test_ranks_with_no_work_are_not_sent_and_get_an_empty_output(executor):
    outputs = executor.execute(a_step(1))
    assert outputs == [RunnerOutput(), RunnerOutput(), RunnerOutput()]
    assert executor.log.sent[-1] == ("execute", 1) and ("execute", 0) not in executor.log.sent
    assert [work.step_ids for work in executor.workers[1].steps] == [["r1"]]
    assert executor.log.gathered[-1][:2] == ("execute", 5.0)  # step_timeout_s


def test_rpc_results_come_in_rank_order_and_default_to_rpc_timeout_s(executor):
    executor.script("get_rank", Answer("zero"), ranks=[0])
    assert executor.collective_rpc("get_rank") == ["zero", 1, 2]
    assert executor.collective_rpc(lambda worker, x: worker.rank * x, args=(10,), ranks=[2, 0]) == [0, 20]
    assert executor.log.gathered[-2][:2] == ("get_rank", 2.0)  # rpc_timeout_s
    executor.collective_rpc("get_rank", timeout=0.25)
    assert executor.log.gathered[-1][:2] == ("get_rank", 0.25)


def test_check_health_asks_every_rank(executor):
    executor.check_health()
    assert executor.log.sent[-3:] == [("check_health", 0), ("check_health", 1), ("check_health", 2)]
    executor.script("check_health", Fails(RuntimeError("device lost")), ranks=[2])
    with pytest.raises(WorkerError, match="worker rank 2 failed in 'check_health': RuntimeError: device lost"):
        executor.check_health()


# A worker exception: WorkerError, the workers live on.


@pytest.mark.parametrize("call", ["step", "rpc"])
def test_a_worker_exception_is_the_lowest_failing_ranks_worker_error_and_the_workers_live_on(executor, call):
    name = "execute" if call == "step" else "get_rank"
    executor.script(name, Fails(ValueError("rank 2 refuses")), ranks=[2])
    executor.script(name, Fails(KeyError("rank 1 refuses")), ranks=[1])
    with pytest.raises(WorkerError) as error:
        executor.execute(a_step(0, 1, 2)) if call == "step" else executor.collective_rpc("get_rank")
    assert error.value.rank == 1 and error.value.raised(KeyError) and error.value.method == name
    assert executor.dead is None and executor.log.stopped == 0 and executor.log.released == 0
    assert executor.collective_rpc("get_rank", ranks=[0]) == [0]


def test_a_worker_error_the_transport_raises_is_the_same(executor):
    executor.script("execute", Raises(WorkerError("execute", 0, "builtins.ValueError", "no", "tb")), ranks=[0])
    with pytest.raises(WorkerError, match="worker rank 0 failed in 'execute': ValueError: no"):
        executor.execute(a_step(0))
    assert executor.dead is None


# A worker that is gone: EngineDeadError, dead for good.


@pytest.mark.parametrize("call", ["step", "rpc"])
@pytest.mark.parametrize("on_send", [False, True])
def test_a_gone_worker_kills_the_executor_with_its_reason(executor, call, on_send):
    reason = "worker rank 1 (pid 99) died (exit code -9) during 'x'"
    name = "execute" if call == "step" else "get_rank"
    executor.script(name, Raises(EngineDeadError(reason), on_send=on_send), ranks=[1])
    with pytest.raises(EngineDeadError, match=re.escape(reason)):
        executor.execute(a_step(0, 1)) if call == "step" else executor.collective_rpc("get_rank")
    assert executor.log.stopped == 1
    assert_dead_for_good(executor, reason)


# A step past its timeout: the workers are stopped and the executor is dead.


def test_a_step_past_its_timeout_stops_the_workers_and_names_step_timeout_s(executor):
    executor.script("execute", Hangs(), ranks=[2])
    with pytest.raises(EngineDeadError) as error:
        executor.execute(a_step(0, 1, 2))
    reason = (
        "worker call 'execute' timed out after 5.0s; ranks that did not answer: [2]; "
        "create a new engine (raise step_timeout_s if steps are that slow)"
    )
    assert str(error.value) == reason
    assert executor.log.stopped == 1
    assert_dead_for_good(executor, reason)


# A step slower than its timeout: waited for while it progresses, on a transport that reports progress.


@pytest.fixture
def progressing(config):
    executor = ProgressingExecutor(config)
    yield executor
    executor.shutdown()


def test_a_step_that_keeps_progressing_is_waited_for_past_its_timeout(progressing):
    progressing.script("execute", Slow(25), ranks=[1])  # answers in its 25th wait, after 24 of 0.5 fake seconds
    progressing.counts[1] = list(range(10, 40))  # read when sent, then after each wait it missed: it moves
    assert progressing.execute(a_step(0, 1, 2)) == [RunnerOutput()] * 3
    assert progressing.dead is None and progressing.now == 12.0  # past twice the 5 s timeout
    # Each rank answered once: the later waits are for rank 1 alone, on the same call, a tenth of the timeout each.
    steps = [(timeout, ids) for name, timeout, ids in progressing.log.gathered if name == "execute"]
    assert [timeout for timeout, _ in steps] == [5.0 / PROGRESS_READS] * 25
    assert len(steps[0][1]) == 3 and all(ids == [steps[0][1][1]] for _, ids in steps[1:])
    assert progressing.log.progress_reads == [[0, 1, 2]] + [[1]] * 24
    assert [len(progressing.workers[rank].steps) for rank in range(3)] == [1, 1, 1]
    assert progressing.collective_rpc("get_rank") == [0, 1, 2]


def test_a_step_whose_progress_stops_is_hung_a_timeout_after_its_last_progress(progressing):
    # Issue 50: it progressed in the first of its waits (of a whole timeout each, then) and was
    # waited for a whole timeout more: hung after 10 s, not 5.
    progressing.script("execute", Hangs(), ranks=[2])
    progressing.counts[2] = [10, 11, 11]  # it progressed before the first read, not after
    with pytest.raises(EngineDeadError) as error:
        progressing.execute(a_step(0, 1, 2))
    assert re.fullmatch(
        r"worker call 'execute' timed out after 5.0s; ranks that did not answer: \[2\] \(no progress in their "
        r"last 5.0s of 5.5s\); create a new engine \(raise step_timeout_s if steps are that slow\)",
        str(error.value),
    )
    # The read that saw its last progress came at 0.5 s; hung 5 s after it.
    assert progressing.now == 5.0 / PROGRESS_READS + 5.0
    assert progressing.log.stopped == 1
    assert_dead_for_good(progressing, str(error.value))


def test_a_step_that_never_progressed_is_hung_after_one_timeout(progressing):
    progressing.script("execute", Hangs(), ranks=[0])
    with pytest.raises(
        EngineDeadError, match=re.escape("timed out after 5.0s; ranks that did not answer: [0]; create")
    ):
        progressing.execute(a_step(0, 1))
    assert progressing.now == 5.0
    assert len([name for name, _, _ in progressing.log.gathered if name == "execute"]) == PROGRESS_READS


def test_an_rpc_is_not_waited_for_past_its_timeout_whatever_the_progress(progressing):
    progressing.script("get_rank", Hangs(), Answer("back"), ranks=[0])
    progressing.counts[0] = list(range(100))
    with pytest.raises(TimeoutError, match=re.escape("worker call 'get_rank' timed out after 2.0s; ranks")):
        progressing.collective_rpc("get_rank")
    assert progressing.log.progress_reads == [] and progressing.dead is None


def test_a_replica_group_progresses_while_any_of_its_ranks_does(model_folder):
    # Two replicas of two ranks: in each, one rank computes while the other waits for it in a collective.
    config = EngineConfig(
        model=model_folder, executor=ProgressingExecutor, num_workers=4, sequence_parallel=2, step_timeout_s=5.0
    )
    executor = ProgressingExecutor(config)
    try:
        executor.script("execute", Slow(20), ranks=[0, 1, 2, 3])
        executor.counts |= {0: [5], 1: list(range(7, 40)), 2: [3], 3: [4]}  # replica 1 (ranks 2, 3) did not move
        with pytest.raises(EngineDeadError, match=re.escape("ranks that did not answer: [0, 1, 2, 3]")):
            executor.execute(SchedulerOutput({0: WorkerInput(step_ids=["a"]), 1: WorkerInput(step_ids=["b"])}))
    finally:
        executor.shutdown()
    executor = ProgressingExecutor(config)
    try:
        executor.script("execute", Slow(20), ranks=[0, 1, 2, 3])
        executor.counts |= {0: [5], 1: list(range(7, 40)), 2: [3], 3: list(range(4, 40))}
        assert (
            len(executor.execute(SchedulerOutput({0: WorkerInput(step_ids=["a"]), 1: WorkerInput(step_ids=["b"])})))
            == 2
        )
        assert executor.dead is None
    finally:
        executor.shutdown()


def test_a_timeout_the_transport_raises_in_a_step_is_the_same(executor):
    executor.script("execute", Raises(TimeoutError("the transport gave up")), ranks=[0])
    with pytest.raises(EngineDeadError, match="the transport gave up; create a new engine .*step_timeout_s"):
        executor.execute(a_step(0))
    assert executor.log.stopped == 1 and executor.dead is not None


# An RPC past its timeout: a TimeoutError, and the executor stays usable.


def test_an_rpc_past_its_timeout_names_method_and_ranks_and_the_executor_lives_on(executor):
    executor.script("get_rank", Hangs(), ranks=[0, 2])
    with pytest.raises(
        TimeoutError, match=re.escape("worker call 'get_rank' timed out after 0.5s; ranks that did not answer: [0, 2]")
    ):
        executor.collective_rpc("get_rank", timeout=0.5)
    late_ids = executor.log.gathered[-1][2]
    assert executor.dead is None and executor.log.stopped == 0
    executor.script("get_rank", Answer("fresh"))
    assert executor.collective_rpc("get_rank") == ["fresh"] * 3
    # The base never waits on a call it gave up on again: its late answer reaches nobody.
    assert not set(late_ids) & {i for _, _, ids in executor.log.gathered[-1:] for i in ids}


def test_a_timeout_the_transport_raises_in_an_rpc_is_the_same(executor):
    executor.script("get_rank", Raises(TimeoutError("the transport gave up")), ranks=[1])
    with pytest.raises(TimeoutError, match="the transport gave up"):
        executor.collective_rpc("get_rank")
    assert executor.dead is None
    assert executor.collective_rpc("get_rank", ranks=[0]) == [0]


# An interrupt (Ctrl-C).


def test_an_interrupt_during_a_step_stops_the_workers_and_leaves_the_executor_dead(executor):
    executor.script("execute", Raises(KeyboardInterrupt()), ranks=[1])
    with pytest.raises(KeyboardInterrupt):
        executor.execute(a_step(0, 1))
    assert executor.log.stopped == 1
    assert_dead_for_good(executor, INTERRUPTED)


def test_an_interrupt_during_an_rpc_raises_and_the_executor_lives_on(executor):
    executor.script("get_rank", Raises(KeyboardInterrupt()), ranks=[1])
    with pytest.raises(KeyboardInterrupt):
        executor.collective_rpc("get_rank")
    assert executor.dead is None and executor.log.stopped == 0
    assert executor.collective_rpc("get_rank", ranks=[0, 2]) == [0, 2]


# Dead for good; kill and shutdown.


def test_kill_stops_the_workers_once_and_keeps_the_first_reason(executor):
    executor.kill("the trainer gave up")
    executor.kill("a later reason")
    assert executor.log.stopped == 1
    assert_dead_for_good(executor, "the trainer gave up")
    executor.shutdown()
    assert executor.log.released == 1 and executor.dead == "the trainer gave up"


def test_shutdown_is_idempotent_and_refuses_later_calls(executor):
    executor.shutdown()
    executor.shutdown()
    assert executor.log.stopped == 0  # a polite stop: nothing was busy
    assert_dead_for_good(executor, SHUT_DOWN)


# What the base checks before anything is sent.


@pytest.mark.parametrize("ranks", [[3], [], [-1], [0, 5]])
def test_ranks_outside_the_workers_are_refused_before_anything_is_sent(executor, ranks):
    sent = len(executor.log.sent)
    with pytest.raises(ValueError, match=re.escape(f"ranks must be a non-empty subset of 0..2, got {ranks}")):
        executor.collective_rpc("get_rank", ranks=ranks)
    assert len(executor.log.sent) == sent and executor.dead is None


@pytest.mark.parametrize(
    "ranks, error, message",
    [
        (1, TypeError, "ranks must be a list of rank numbers (e.g. [1]), or None for all, got 1"),
        (["0"], TypeError, "ranks must be a list of rank numbers (ints), got ['0']"),
        ((2, 0, 2), ValueError, "ranks names [2] more than once (got [2, 0, 2]); name each rank once"),
    ],
)
def test_ranks_that_are_not_a_list_of_distinct_ranks_are_refused(executor, ranks, error, message):
    """A bare rank and a rank named twice (which answered once) are refused before anything is sent."""
    sent = len(executor.log.sent)
    with pytest.raises(error, match=re.escape(message)):
        executor.collective_rpc("get_rank", ranks=ranks)
    assert len(executor.log.sent) == sent and executor.dead is None


def test_ranks_are_sorted(executor):
    assert executor.collective_rpc("get_rank", ranks=(2, 0)) == [0, 2]


def test_unknown_methods_are_refused_before_anything_is_sent(executor):
    sent = len(executor.log.sent)
    with pytest.raises(ValueError, match="unknown worker method 'nope'; available: .*'get_rank'"):
        executor.collective_rpc("nope")
    with pytest.raises(TypeError, match="must be a worker method name or a callable, got 3"):
        executor.collective_rpc(3)
    assert len(executor.log.sent) == sent


# An executor written to the older contract (its own `_execute` and `_collective_rpc`) is refused.


class OwnLifecycleExecutor(Executor):
    """An executor in the shape the README showed before issue 20: it starts its own workers and
    writes `_execute`, `_collective_rpc`, `check_health` and `shutdown`."""

    def _execute(self, scheduler_output, timeout):
        return [RunnerOutput() for _ in range(self.num_workers)]

    def _collective_rpc(self, name, method, args, kwargs, timeout, ranks):
        return [f"{name} on {rank}" for rank in ranks]


def test_an_executor_of_the_older_contract_is_refused_before_any_worker_starts(config, tmp_path):
    from rollout.engine.config_check import class_problems

    with pytest.raises(TypeError, match="writes _execute and _collective_rpc, the older executor contract"):
        OwnLifecycleExecutor(config)
    problems = class_problems(executor=OwnLifecycleExecutor)
    assert any("_start_workers, _send_rpc, _gather, _release_workers missing" in p for p in problems)
    assert any("the older executor contract, which is gone" in p for p in problems)


class HalfATransport(Executor):
    def _start_workers(self, bootstrap):
        return {}


def test_an_executor_without_a_transport_is_refused_with_what_is_missing(config):
    with pytest.raises(
        TypeError,
        match="HalfATransport does not define its transport: _send_rpc, _gather, _release_workers missing",
    ):
        HalfATransport(config)
    with pytest.raises(TypeError, match="Executor does not define its transport"):
        Executor(config)


# The engine over a scripted executor: a dead executor fails every request at once.


@pytest.fixture
def engine(config):
    with RolloutEngine(config) as engine:
        yield engine


PARAMS = SamplingParams(num_inference_steps=4, num_samples=2, seed=0)


@pytest.mark.parametrize(
    "outcome, reason",
    [
        (Raises(EngineDeadError("worker rank 1 is gone")), "worker rank 1 is gone"),
        (Hangs(), "timed out after 5.0s; ranks that did not answer: [1]; create a new engine"),
    ],
)
def test_an_engine_whose_executor_dies_fails_every_request_and_every_later_call(engine, outcome, reason):
    engine.add_request("a", PARAMS, request_id="a")
    engine.add_request("b", PARAMS, request_id="b")
    engine.step()  # every rank holds requests now
    assert engine.has_unfinished_requests()
    engine.executor.script("execute", outcome, ranks=[1])
    with pytest.raises(EngineDeadError, match=re.escape(reason)):
        engine.step()
    assert not engine.has_unfinished_requests() and engine.unfinished_request_ids() == []
    sent = len(engine.executor.log.sent)
    with pytest.raises(EngineDeadError, match=re.escape(reason)):
        engine.generate("c", PARAMS)
    with pytest.raises(EngineDeadError, match=re.escape(reason)):
        engine.collective_rpc("get_rank")
    with pytest.raises(EngineDeadError, match=re.escape(reason)):
        engine.check_health()
    assert len(engine.executor.log.sent) == sent
    assert engine.executor.log.stopped == 1


def test_an_interrupted_engine_step_leaves_the_engine_dead(engine):
    engine.executor.script("execute", Raises(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        engine.generate("a", PARAMS)
    assert engine.dead is not None and not engine.has_unfinished_requests()
    with pytest.raises(EngineDeadError, match=re.escape(INTERRUPTED)):
        engine.generate("b", PARAMS)


def test_an_engine_rpc_timeout_leaves_the_engine_serving(engine):
    engine.executor.script("get_rank", Hangs(), Answer("back"), ranks=[2])
    with pytest.raises(TimeoutError, match=re.escape("ranks that did not answer: [2]")):
        engine.collective_rpc("get_rank", timeout=1.0)
    assert engine.dead is None
    assert engine.collective_rpc("get_rank") == [0, 1, "back"]


class RecordingSends(ScriptedExecutor):
    """Records the (name, method) of every call the base sends."""

    def __init__(self, config: EngineConfig):
        self.sends: list[tuple[str, object]] = []
        super().__init__(config)

    def _send_rpc(self, name, method, args, kwargs, ranks, step=False):
        self.sends.append((name, method))
        return super()._send_rpc(name, method, args, kwargs, ranks, step)


def test_a_worker_function_named_by_reference_travels_as_its_name(config):
    from rollout.worker.worker import Worker

    def rank_of(worker):
        return worker.rank

    executor = RecordingSends(config)
    try:
        assert executor.collective_rpc(Worker.get_rank) == [0, 1, 2]
        assert executor.collective_rpc("get_rank") == [0, 1, 2]
        assert executor.collective_rpc(rank_of) == [0, 1, 2]
        assert executor.sends[-3:] == [
            ("get_rank", "get_rank"),
            ("get_rank", "get_rank"),
            (rank_of.__qualname__, rank_of),
        ]
        with pytest.raises(ValueError, match="unknown worker method 'no_such_function'"):
            executor.collective_rpc("no_such_function")
    finally:
        executor.shutdown()


class OwnStepSend(ScriptedExecutor):
    def _send_step(self, rank, work):
        raise AssertionError("a step reaches _send_rpc: this is never called")


def test_an_executor_that_still_sends_its_steps_itself_is_refused(config):
    from executors.base import transport_problems

    assert transport_problems(ScriptedExecutor) == []
    (problem,) = transport_problems(OwnStepSend)
    assert "writes _send_step, the older executor contract" in problem
