"""sleep/wake_up free and restore the weights; generating while asleep is a clear error."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from rollout.weights import base_state

pytestmark = pytest.mark.timeout(120)


def _images(engine):
    return [o.image for o in engine.generate(["a", "b"], SamplingParams(num_inference_steps=2, num_samples=2, seed=1))]


def _weight_elements(engine) -> int:
    return engine.collective_rpc(
        lambda worker: sum(t.numel() for t in base_state(worker.adapter.transformer).values())
    )[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_weights_and_wake_up_restores_them(engine, level):
    before = _images(engine)
    digest = engine.weights_checksum()
    engine.sleep(level)
    engine.sleep(level)  # idempotent
    assert _weight_elements(engine) == 0
    with pytest.raises(RuntimeError, match=f"asleep \\(level {level}\\); call wake_up\\(\\) before generating"):
        engine.generate("x", SamplingParams(num_inference_steps=1))
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights({})
    engine.wake_up()
    engine.wake_up()  # idempotent
    assert _weight_elements(engine) > 0
    assert engine.weights_checksum() == digest
    assert all(torch.equal(a, b) for a, b in zip(before, _images(engine), strict=True))


def test_level_2_reloads_the_saved_weights_and_resets_the_version(engine):
    digest = engine.weights_checksum()
    state = engine.collective_rpc(
        lambda worker: {n: t.clone() for n, t in base_state(worker.adapter.transformer).items()}
    )[0]
    engine.update_weights({name: t + 1 for name, t in state.items()})
    assert engine.weight_version > 0 and engine.weights_checksum() != digest
    engine.sleep(1)
    engine.sleep(2)  # deeper: the host copy goes too
    engine.wake_up()
    assert engine.weights_checksum() == digest  # the model folder's weights
    assert engine.weight_version == 0


def test_cannot_sleep_with_requests_in_flight(engine):
    engine.add_request("x", SamplingParams(num_inference_steps=3, seed=0), request_id="busy")
    with pytest.raises(RuntimeError, match="cannot sleep with 1 unfinished requests"):
        engine.sleep(1)
    engine.abort("busy")
    with pytest.raises(ValueError, match="sleep level must be 1"):
        engine.sleep(3)
