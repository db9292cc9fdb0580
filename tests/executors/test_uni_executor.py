"""Executor resolution and collective_rpc on the in-process backend."""

from __future__ import annotations

import time

import pytest
import torch

from executors import Executor, get_executor_class
from executors.uni import UniExecutor
from rollout import EngineConfig, RolloutEngine
from rollout.errors import WorkerError
from rollout.worker.worker import _WORKER_ATTRIBUTES

pytestmark = pytest.mark.timeout(60)


class CountingExtension:
    """A user's worker functions, mixed into every worker."""

    def count_requests(self) -> int:
        return len(self.requests)

    def add(self, a, b=0):
        return (self.rank, a + b)


class RecordingExecutor(UniExecutor):
    """A user's executor: the standard path plus its own bookkeeping."""

    def execute(self, scheduler_output):
        self.steps = getattr(self, "steps", 0) + 1
        return super().execute(scheduler_output)


class NotAnExecutor:
    pass


def test_get_executor_class_resolves_names_classes_and_paths():
    assert get_executor_class("uni") is UniExecutor
    assert get_executor_class(RecordingExecutor) is RecordingExecutor
    assert get_executor_class(f"{__name__}.RecordingExecutor") is RecordingExecutor
    assert issubclass(get_executor_class("uni"), Executor)


def test_get_executor_class_refuses_what_is_not_an_executor():
    with pytest.raises(TypeError, match="NotAnExecutor.* is not a subclass of executors.Executor"):
        get_executor_class(f"{__name__}.NotAnExecutor")
    with pytest.raises(TypeError, match="is not a subclass of executors.Executor"):
        get_executor_class(NotAnExecutor)
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg'"):
        get_executor_class("no_such_pkg.Executor")
    with pytest.raises(ValueError, match="unknown executor 'gpu'"):
        get_executor_class("gpu")


@pytest.fixture(scope="module")
def extended_engine(tiny_model):
    config = EngineConfig(
        model=tiny_model,
        executor=f"{__name__}.RecordingExecutor",
        worker_extension_cls=f"{__name__}.CountingExtension",
    )
    with RolloutEngine(config) as engine:
        yield engine


def test_external_executor_runs_the_standard_path(extended_engine):
    from rollout import SamplingParams

    outputs = extended_engine.generate("x", SamplingParams(num_inference_steps=3, seed=0))
    assert outputs[0].status == "finished"
    assert extended_engine.executor.steps >= 3


def test_collective_rpc_by_name_extension_and_callable(extended_engine):
    assert extended_engine.collective_rpc("get_rank") == [0]
    assert extended_engine.collective_rpc("count_requests") == [0]
    assert extended_engine.collective_rpc("add", args=(2,), kwargs={"b": 3}) == [(0, 5)]
    assert extended_engine.collective_rpc(lambda worker, x: (worker.rank, x * 2), args=(21,)) == [(0, 42)]
    assert extended_engine.collective_rpc("get_rank", ranks=[0]) == [0]
    with pytest.raises(ValueError, match="ranks must be a non-empty subset of 0..0"):
        extended_engine.collective_rpc("get_rank", ranks=[1])


def test_collective_rpc_timeout_in_process_and_late_reply_is_dropped(extended_engine):
    def slow(worker, seconds):
        time.sleep(seconds)
        return "late"

    slow_s = 1.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="'.*slow' timed out after 0.2s; ranks that did not answer: \\[0\\]"):
        extended_engine.collective_rpc(slow, args=(slow_s,), timeout=0.2)
    assert time.monotonic() - start < slow_s  # it did not wait for the worker
    # The next call waits for the slow one to finish and gets its own answer.
    assert extended_engine.collective_rpc("get_rank") == [0]


def test_worker_exception_carries_rank_and_traceback(extended_engine):
    def broken(worker):
        raise KeyError("missing thing")

    with pytest.raises(WorkerError) as error:
        extended_engine.collective_rpc(broken)
    assert error.value.rank == 0
    assert "KeyError" in error.value.error and "missing thing" in error.value.error
    assert "in broken" in error.value.remote_traceback
    assert extended_engine.collective_rpc("get_rank") == [0]  # the worker lives on


class ClashingExtension:
    def execute(self, work):
        return None


def test_extension_that_redefines_a_worker_method_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"ClashingExtension redefines worker methods \['execute'\]"):
        RolloutEngine(EngineConfig(model=tiny_model, worker_extension_cls=ClashingExtension))


def test_the_attributes_an_extension_may_not_shadow_are_the_ones_a_worker_sets(extended_engine):
    """`build_worker_class` refuses an extension method named as a worker's instance attribute from
    a hand-kept list: a new attribute missing from it would hide such a method silently."""
    assert set(vars(extended_engine.executor.worker)) == _WORKER_ATTRIBUTES


def test_engine_after_shutdown_refuses_calls(tiny_model):
    engine = RolloutEngine(EngineConfig(model=tiny_model))
    engine.shutdown()
    engine.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        engine.collective_rpc("get_rank")


def test_a_step_past_its_timeout_marks_the_engine_dead(tiny_model):
    from rollout import SamplingParams
    from rollout.errors import EngineDeadError

    with RolloutEngine(EngineConfig(model=tiny_model, step_timeout_s=0.3)) as engine:
        step_s = 1.0
        engine.collective_rpc(lambda worker: setattr(worker.runner, "step", lambda states: time.sleep(step_s)))
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"'execute' timed out after 0.3s; .*raise step_timeout_s"):
            engine.generate("x", SamplingParams(num_inference_steps=2, seed=0))
        assert time.monotonic() - start < step_s  # it did not wait for the step
        with pytest.raises(EngineDeadError):
            engine.collective_rpc("get_rank")


def test_tensors_handed_over_reach_the_worker_uncopied_and_the_others_as_copies(extended_engine):
    from rollout.weights.handed_over import HandedOver

    def pointers(worker, tensor, nested):
        return tensor.data_ptr(), [t.data_ptr() for t in nested["tensors"]]

    kept, given = torch.ones(3), torch.zeros(2)
    copied, handed = extended_engine.collective_rpc(pointers, args=(kept, HandedOver({"tensors": [given]})))[0]
    assert copied != kept.data_ptr()  # the caller may change `kept` at once: the worker has its own
    assert handed == [given.data_ptr()]


def test_an_update_handed_over_becomes_the_weights_as_it_is(extended_engine):
    from rollout.weights.handed_over import HandedOver
    from rollout.weights.state import base_state, checksum

    def weights(worker):
        return base_state(worker.adapter.transformer)

    original = {name: t.clone() for name, t in extended_engine.collective_rpc(weights)[0].items()}
    pushed = {name: t + 0.5 for name, t in original.items()}
    extended_engine.update_weights(HandedOver(iter(pushed.items())))  # an iterator, as the server's stream
    live = extended_engine.collective_rpc(weights)[0]
    assert {name: t.data_ptr() for name, t in live.items()} == {name: t.data_ptr() for name, t in pushed.items()}
    assert extended_engine.weights_checksum() == checksum(pushed)
    extended_engine.update_weights(original)  # not handed over: the worker keeps copies
    live = extended_engine.collective_rpc(weights)[0]
    assert all(live[name].data_ptr() != t.data_ptr() for name, t in original.items())
    assert extended_engine.weights_checksum() == checksum(original)
