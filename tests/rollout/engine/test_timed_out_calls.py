"""A state-changing call that times out may still finish in the worker: the engine reads the workers'
state back instead of acting on a guess, or (a LoRA load, which is staged first) rolls it back."""

from __future__ import annotations

import time

import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams

pytestmark = pytest.mark.timeout(120)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


def _late(worker, owner: str, method: str, seconds: float) -> None:
    """Make `worker.<owner>.<method>` finish `seconds` late (past the engine's timeout)."""
    target = getattr(worker, owner)
    original = getattr(target, method)

    def late(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    setattr(target, method, late)


def _on_time(worker, owner: str, method: str) -> None:
    vars(getattr(worker, owner)).pop(method, None)


def _lora_tensors(engine) -> dict:
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from rollout.pipelines.loading import load_adapter

    transformer = load_adapter(engine.config.model).transformer
    transformer.add_adapter(LoraConfig(**LORA, init_lora_weights=False), adapter_name="made")
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(transformer, adapter_name="made").items()}


def test_a_timed_out_load_that_finishes_later_is_rolled_back_everywhere(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model, rpc_timeout_s=1.0)) as engine:
        tensors = _lora_tensors(engine)
        version = engine.weight_version
        engine.collective_rpc(_late, args=("loras", "stage", 2.0))
        with pytest.raises(TimeoutError, match="rolled back on every rank, which keeps no adapter named 'policy'"):
            engine.load_lora("policy", tensors, LORA)
        engine.collective_rpc(_on_time, args=("loras", "stage"))
        assert engine.list_loras() == [] and engine.weight_version == version
        assert engine.collective_rpc("hot_swap_state")[0]["loras"] == {}
        assert engine.load_lora("policy", tensors, LORA) == version + 1
        (output,) = engine.generate("x", SamplingParams(num_inference_steps=2, seed=0, lora="policy"))
        assert output.weight_version == version + 1 and torch.isfinite(output.trajectory.latents.stack()).all()


def test_a_timed_out_sleep_and_wake_up_leave_the_engine_knowing_the_level(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model, rpc_timeout_s=1.0)) as engine:
        engine.collective_rpc(_late, args=("sleeper", "sleep", 2.0))
        with pytest.raises(TimeoutError, match="sleep level 2"):
            engine.sleep(2)
        assert engine.sleep_level == 2
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate("x", SamplingParams(num_inference_steps=1))
        engine.collective_rpc(_late, args=("sleeper", "wake_up", 2.0))
        with pytest.raises(TimeoutError, match="sleep level 0"):
            engine.wake_up()
        assert engine.sleep_level == 0 and engine.weight_version == 0
        engine.generate("x", SamplingParams(num_inference_steps=1, seed=0))
