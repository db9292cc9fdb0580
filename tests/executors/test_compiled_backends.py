"""Compiled blocks (`EngineConfig.compile="blocks"`) on the executors users run beside 'uni': 'mp',
'ray' and a CFG-parallel group sample what an eager in-process engine samples, every trajectory
says it was compiled, and no worker recompiles across batch sizes, adapters and a weight push once
its first graphs exist. Sequence parallel cannot compile; it is refused before any worker starts."""

from __future__ import annotations

import logging
import sys

import cloudpickle
import pytest

from rollout import EngineConfig, RolloutEngine
from rollout.weights.state import base_state
from tests.families import FAMILIES
from tests.rollout.pipelines.test_compiled_blocks import CONFIG, TOLERANCE, _close
from trainers_adapters.policy.lora_policy import LoraPolicy

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import the tests

pytestmark = pytest.mark.timeout(300)
logger = logging.getLogger(__name__)

SD3 = FAMILIES["sd3"]
BACKENDS = {
    "mp": {"executor": "mp", "num_workers": 2},
    "ray": {"executor": "ray", "num_workers": 2},
    "mp-cfg": {"executor": "mp", "num_workers": 2, "cfg_parallel": 2},
}


def test_sequence_parallel_with_compiled_blocks_is_refused_naming_both_ways_out(tiny_model):
    # Refused by the config's values alone, before any model is read or worker started.
    with pytest.raises(ValueError, match="compile='blocks' cannot run with sequence_parallel=2") as refused:
        EngineConfig(model=tiny_model, executor="mp", num_workers=2, sequence_parallel=2, compile="blocks")
    assert "compile='off' with sequence_parallel" in str(refused.value)
    assert "sequence_parallel=1 with compile='blocks'" in str(refused.value)


def _graphs(worker) -> int:
    """Graphs dynamo has compiled in this worker's process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def adapters(tiny_model):
    """Two LoRA adapters' tensors (`a`, `b`) and their config, and a base state pushed as weights."""
    policy = LoraPolicy(tiny_model, CONFIG)
    lora = policy.lora_state()
    pushed = {name: tensor * 0.99 for name, tensor in base_state(policy.adapter.transformer).items()}
    return {"a": lora, "b": {key: tensor + 0.01 for key, tensor in lora.items()}}, policy.lora_config, pushed


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_compiled_backend_samples_what_eager_uni_does_without_recompiles(request, backend, tiny_model, adapters):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    loras, lora_config, pushed = adapters
    config = EngineConfig(model=tiny_model, max_batch_size=8, compile="blocks", **BACKENDS[backend])
    with RolloutEngine(config) as compiled, RolloutEngine(EngineConfig(model=tiny_model, max_batch_size=8)) as eager:
        # Adapters first: PEFT wraps the targeted layers once, so one module tree reaches the blocks.
        for engine in (compiled, eager):
            for name, tensors in loras.items():
                engine.load_lora(name, tensors, lora_config)
        worst, outputs = 0.0, []

        def both(count: int, **params) -> None:
            nonlocal worst
            params = SD3.params(num_inference_steps=2, seed=count, **params)
            got = compiled.generate(["a red square"] * count, params)
            want = eager.generate(["a red square"] * count, params)
            outputs.extend(got)
            worst = max(worst, _close(got, want))

        for count in range(1, 7):  # every rank sees batches of one row and of several, CFG on and off
            both(count, lora=(None, "a", "b")[count % 3], cfg=bool(count % 2))
        first = compiled.collective_rpc(_graphs)
        for engine in (compiled, eager):
            engine.update_weights(pushed)
        for count in (7, 3, 1, 4):
            both(count, lora=("a", "b")[count % 2], cfg=bool(count % 2))
        after = compiled.collective_rpc(_graphs)
    logger.info("%s compiled vs eager uni: worst %.2e, graphs per worker %s -> %s", backend, worst, first, after)
    assert {output.trajectory.compile for output in outputs} == {"blocks"}
    assert worst < TOLERANCE
    # SD3's two block variants x (a batch of one row, any other batch): at most 4 graphs per worker.
    assert all(0 < graphs <= 4 for graphs in first), first
    assert after == first, f"workers recompiled: graphs {first} -> {after}"
