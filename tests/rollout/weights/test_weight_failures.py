"""An update whose rollback or commit fails leaves ranks that may disagree: the engine stops with an
error that names what went wrong first, instead of serving split weights."""

from __future__ import annotations

import time

import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.errors import EngineDeadError
from rollout.weights.state import base_state

pytestmark = pytest.mark.timeout(120)


def _weights(engine) -> dict:
    return engine.collective_rpc(
        lambda worker: {n: t.clone() for n, t in base_state(worker.adapter.transformer).items()}
    )[0]


def _break(worker, method: str, behaviour: str) -> None:
    def fail(component):
        if behaviour == "hang":
            time.sleep(3)
        else:
            raise RuntimeError(f"{method} failed")

    setattr(worker.updates, method, fail)


def test_a_failing_rollback_does_not_hide_the_first_error(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        weights = _weights(engine)
        engine.collective_rpc(_break, args=("apply", "raise"))
        engine.collective_rpc(_break, args=("rollback", "raise"))
        with pytest.raises(EngineDeadError, match="apply failed.*rolling it back failed too.*rollback failed"):
            engine.update_weights({n: t + 1 for n, t in weights.items()})
        with pytest.raises(EngineDeadError):  # stays dead: no split weights are ever sampled
            engine.generate("x", SamplingParams(num_inference_steps=1))


def test_a_commit_that_times_out_stops_the_engine(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model, rpc_timeout_s=1.0)) as engine:
        weights = _weights(engine)
        engine.collective_rpc(_break, args=("commit", "hang"))
        with pytest.raises(EngineDeadError, match="committing the update of transformer failed on some rank"):
            engine.update_weights(weights)
        with pytest.raises(EngineDeadError):
            engine.weights_checksum()


def _break_lora_switch(worker) -> None:
    """Stage any adapter, then fail to switch to it and to drop it."""

    def fail(name):
        raise RuntimeError(f"device lost with {name}")

    worker.loras.stage = lambda name, tensors, config, check_finite: 3
    worker.loras.commit = fail
    worker.loras.rollback = fail


def test_a_lora_commit_whose_unload_fails_too_stops_the_engine(tiny_model):
    """Ranks that may disagree on what an adapter is must not serve, as after a failed rollback:
    `HotSwap` raises EngineDeadError and the engine dies of it."""
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        engine.collective_rpc(_break_lora_switch)
        with pytest.raises(EngineDeadError, match="(?s)committing LoRA .policy. failed .*unloading it failed too"):
            engine.load_lora("policy", {"a": torch.ones(1)}, {"r": 1})
        assert engine.dead is not None and engine.list_loras() == []
        with pytest.raises(EngineDeadError, match="unloading it failed too"):
            engine.load_lora("other", {"a": torch.ones(1)}, {"r": 1})


def test_a_streamed_push_whose_drop_fails_stops_the_engine(tiny_model):
    """A push opened with `open_weight_push` whose body failed is dropped; a drop that fails on a
    rank leaves ranks that may disagree, as a failed rollback does anywhere else."""
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        weights = _weights(engine)
        push = engine.open_weight_push()
        push.add(iter(weights.items()))
        engine.collective_rpc(_break, args=("rollback", "raise"))
        with pytest.raises(EngineDeadError, match="rollback failed"):
            engine.abort_weight_push(push, ValueError("the body was cut off"))
        with pytest.raises(EngineDeadError):
            engine.generate("x", SamplingParams(num_inference_steps=1))
