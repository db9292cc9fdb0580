"""What a replica group of two ranks (Ulysses, over gloo on CPU) runs beside plain rollouts, each
equal to one worker: latent outputs, a trainer's sigmas, weights broadcast by a trainer, LoRA
adapters (and the refusal of one where diffusers splits or gathers the sequence), and the async
engine. One group engine and one single-worker engine serve every test (a group's start costs
~50 s of CPU on the 2-core machine)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from rollout.weights.state import base_state, checksum
from tests.families import ALL_FAMILIES as FAMILIES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # two worker processes in a gloo group

FLUX = FAMILIES["flux"]
TOLERANCE = 1e-5  # latents and log-probs of a group against one worker (the bound)
PROMPTS = ["a red square", "a small blue circle on a wide green field, drawn at noon in soft light"]
# Unmerged adapters: the path that would meet diffusers' sequence split (merged ones change base weights).
MERGE_LORA = "never"


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models("flux")


@pytest.fixture(scope="module")
def group(model):
    config = EngineConfig(model=model, executor="mp", num_workers=2, sequence_parallel=2, merge_lora=MERGE_LORA)
    with RolloutEngine(config) as engine:
        yield engine


@pytest.fixture(scope="module")
def single(model):
    with RolloutEngine(EngineConfig(model=model, merge_lora=MERGE_LORA)) as engine:
        yield engine


def _params(**kwargs):
    return FLUX.params(num_inference_steps=4, num_samples=2, seed=7, sampler="flow_sde", sde_window=(0, 3), **kwargs)


def _assert_close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.prompt, g.sample_index, g.status) == (w.prompt, w.sample_index, "finished")
        assert (g.trajectory.latents.stack() - w.trajectory.latents.stack()).abs().max() < TOLERANCE
        assert (g.trajectory.log_probs - w.trajectory.log_probs).abs().max() < TOLERANCE
        assert g.trajectory.sde_mask.any()


@pytest.mark.parametrize(
    "setting", [{"output_type": "latent"}, {"sigmas": (1.0, 0.8, 0.55, 0.3)}], ids=["latent", "sigmas"]
)
def test_latent_outputs_and_a_trainer_s_sigmas(group, single, setting):
    params = _params(**setting)
    got, want = group.generate(PROMPTS, params), single.generate(PROMPTS, params)
    _assert_close(got, want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.trajectory.sigmas, w.trajectory.sigmas)
        if "output_type" in setting:
            assert g.image is None and (g.latents - w.latents).abs().max() < TOLERANCE
    if "sigmas" in setting:  # the trainer's schedule, not the pipeline's (the family's shift still applies)
        assert not torch.equal(got[0].trajectory.sigmas, group.generate(PROMPTS[:1], _params())[0].trajectory.sigmas)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_weights_a_trainer_broadcasts_reach_every_rank(group, single, model):
    from rollout.pipelines.loading import load_adapter
    from trainers_adapters.weights.broadcast import join_engine

    original = {name: t.detach().clone() for name, t in base_state(load_adapter(model).transformer).items()}
    shifted = {name: t * 0.9 for name, t in original.items()}
    broadcaster = join_engine(group, "127.0.0.1", _free_port())  # the trainer: rank 0, the group's ranks 1 and 2
    try:
        assert broadcaster.push(group, shifted, bucket_bytes=32 * 1024) == group.weight_version
        assert group.collective_rpc("weights_checksum", args=("transformer",)) == [checksum(shifted)] * 2
        single.update_weights(shifted)
        _assert_close(group.generate(PROMPTS, _params()), single.generate(PROMPTS, _params()))
    finally:
        group.update_weights(original)
        single.update_weights(original)


def _lora(model: str, targets: list[str]) -> tuple[dict, dict]:
    """A random rank-4 adapter (PEFT keys) on `targets`, made on a separate copy of the transformer."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from rollout.pipelines.loading import load_adapter

    transformer = load_adapter(model).transformer
    torch.manual_seed(0)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(transformer).items()}
    return tensors, {"r": 4, "lora_alpha": 8, "target_modules": targets}


def test_a_lora_where_the_sequence_is_gathered_is_refused_and_one_elsewhere_samples_as_one_worker(
    group, single, model
):
    """FLUX.1's `proj_out` carries diffusers' gather hook: unmerged, PEFT's layer would add its
    path on one rank's tokens to the base layer's gathered output (a shape error at best). The
    single-stream blocks' `proj_out`s, inside the sharded part, are fine."""
    tensors, config = _lora(model, ["proj_out"])
    with pytest.raises(ValueError, match=r"targets transformer modules \['proj_out'\], where sequence parallel"):
        group.load_lora("at_the_gather", tensors, config)
    assert group.list_loras() == []  # refused whole, on every rank
    tensors, config = _lora(model, ["to_q", "single_transformer_blocks.0.proj_out"])
    group.load_lora("inside", tensors, config)
    single.load_lora("inside", tensors, config)
    try:
        params = _params(lora="inside")
        _assert_close(group.generate(PROMPTS, params), single.generate(PROMPTS, params))
    finally:
        group.unload_lora("inside")
        single.unload_lora("inside")


def test_the_async_engine_streams_what_one_worker_samples(group, single):
    """Last in this module: the async engine owns the group engine from here on and shuts it down."""
    from rollout.engine.async_engine import AsyncRolloutEngine

    async def stream(engine: AsyncRolloutEngine, prompt: str) -> list:
        return [output async for output in engine.generate_stream([prompt], _params())]

    async def main() -> list[list]:
        engine = AsyncRolloutEngine(group)
        try:
            return await asyncio.gather(*(stream(engine, prompt) for prompt in PROMPTS))  # two callers at once
        finally:
            engine.shutdown()

    for prompt, got in zip(PROMPTS, asyncio.run(main()), strict=True):
        want = single.generate([prompt], _params())
        _assert_close(sorted(got, key=lambda o: o.sample_index), want)
