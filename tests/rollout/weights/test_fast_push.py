"""Pushes written once into the workers' staging buffers, and delta pushes: after every push each
rank's `weights_checksum()` equals the pushed state's (the engine's checksum raises if ranks
disagree), on uni, on mp with 2 replicas and on ray; the caller's tensors stay the caller's; a
refused push leaves weights and version as they were, and the next one goes through."""

from __future__ import annotations

import os
import sys

import cloudpickle
import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.errors import EngineDeadError
from rollout.weights.state import base_state, checksum
from tests.executors import worker_functions
from tests.executors.worker_functions import wait_gone, worker_pid

# Ray workers cannot import the test modules: ship the worker functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(worker_functions)

pytestmark = pytest.mark.timeout(180)


def _live_state(engine) -> dict[str, torch.Tensor]:
    return engine.collective_rpc(
        lambda worker: {n: t.clone() for n, t in base_state(worker.adapter.transformer).items()}, ranks=[0]
    )[0]


def _pushes_stay_exact(engine) -> None:
    state = _live_state(engine)
    names = sorted(n for n, t in state.items() if t.is_floating_point())
    for _ in range(3):  # three full pushes: the third reuses the first one's buffers
        for name in names:
            state[name].add_(0.5)
        version = engine.update_weights(state, bucket_bytes=2**16)  # several buckets
        assert engine.weights_checksum() == checksum(state)
        assert engine.hot_swap.last_push.changed_fraction == 1.0
    first = engine.update_weights(state, delta=True)  # no record yet: everything is sent
    assert first == version + 1 and engine.hot_swap.last_push.sent_tensors == len(state)
    for step in range(3):
        changed = names[step::7]
        for name in changed:
            state[name].mul_(-1.5)
        engine.update_weights(state, delta=True, bucket_bytes=2**16)
        report = engine.hot_swap.last_push
        assert report.delta and report.sent_tensors == len(changed), report
        assert 0 < report.changed_fraction < 1
        assert engine.weights_checksum() == checksum(state)
    engine.update_weights(state, delta=True)  # nothing changed: nothing sent, the version still moves
    assert engine.hot_swap.last_push.sent_tensors == 0
    assert engine.weights_checksum() == checksum(state)


def test_full_and_delta_pushes_are_exact_on_uni(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        _pushes_stay_exact(engine)
        _a_refused_push_changes_nothing(engine)


def test_full_and_delta_pushes_are_exact_on_two_mp_replicas(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model, executor="mp", num_workers=2)) as engine:
        assert engine.executor.num_replicas == 2
        _pushes_stay_exact(engine)
        _a_refused_push_changes_nothing(engine)


@pytest.mark.slow
def test_full_and_delta_pushes_are_exact_on_two_ray_replicas(tiny_model):
    pytest.importorskip("ray")
    with RolloutEngine(EngineConfig(model=tiny_model, executor="ray", num_workers=2)) as engine:
        _pushes_stay_exact(engine)
        _a_refused_push_changes_nothing(engine)


def test_the_callers_tensors_stay_the_callers(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        state = {n: t + 1 for n, t in _live_state(engine).items() if t.is_floating_point()}
        engine.update_weights(state)
        pushed = engine.weights_checksum()
        for tensor in state.values():
            tensor.zero_()  # an optimizer step in place, right after the push
        assert engine.weights_checksum() == pushed


def _a_refused_push_changes_nothing(engine) -> None:
    """A NaN found as the last bucket is written: weights and version stay, and the staging
    buffers reserved for it are given up, so the next push goes through."""
    state = _live_state(engine)
    before, version = engine.weights_checksum(), engine.weight_version
    names = sorted(n for n, t in state.items() if t.is_floating_point())
    broken = {n: t + 1 for n, t in state.items()}
    broken[names[-1]][0] = float("nan")
    with pytest.raises(ValueError, match=f"{names[-1]}: holds NaN"):
        engine.update_weights(broken, bucket_bytes=2**16)
    assert engine.weights_checksum() == before and engine.weight_version == version
    broken[names[-1]][0] = 0.0
    engine.update_weights(broken, bucket_bytes=2**16)
    assert engine.weights_checksum() == checksum(broken)


def test_a_sleep_makes_the_next_delta_push_whole(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        state = _live_state(engine)
        engine.update_weights(state, delta=True)
        engine.sleep(1)
        engine.wake_up()
        engine.update_weights(state, delta=True)
        assert engine.hot_swap.last_push.sent_tensors == len(state)
        assert engine.weights_checksum() == checksum(state)


def _die_when_the_next_bucket_is_staged(worker) -> None:
    """Rank 1's process exits, as one the OS killed, when it stages the next bucket of a push: after
    rank 0 staged it, before anything is applied."""
    if worker.rank == 1:
        worker.staging.take = lambda nbytes: os._exit(9)


@pytest.mark.parametrize("executor", ["mp", pytest.param("ray", marks=pytest.mark.slow)])
def test_a_replica_that_dies_mid_push_ends_the_engine_naming_it(request, tiny_model, executor):
    """The push fails with the dead worker's rank, the engine is dead for every later call (no output
    is ever sampled with half a push), and the surviving replica's process is stopped too, its
    staged bucket with it (issue 54 replaces a replica instead)."""
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    params = SamplingParams(num_inference_steps=2, num_samples=2, seed=0)
    with RolloutEngine(EngineConfig(model=tiny_model, executor=executor, num_workers=2)) as engine:
        state = _live_state(engine)
        pids = engine.collective_rpc(worker_pid)
        engine.collective_rpc(_die_when_the_next_bucket_is_staged)
        new = {name: tensor + 1 if tensor.is_floating_point() else tensor for name, tensor in state.items()}
        with pytest.raises(EngineDeadError, match=r"worker rank 1 .*died"):
            engine.update_weights(new, bucket_bytes=2**16)
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            engine.generate(["a red square"], params)
        with pytest.raises(EngineDeadError):
            engine.weights_checksum()
        assert wait_gone(pids) == []
