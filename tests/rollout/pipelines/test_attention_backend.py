"""`EngineConfig.attention_backend`: diffusers' attention dispatcher names, checked against what the
installed diffusers and torch run on the configured device before any worker starts, applied by
every worker to every denoiser, and taken by the trainer's copy (`load_adapter`, `LoraPolicy`), so
a rollout sampled with one kernel re-scores within the contract with the same kernel."""

from __future__ import annotations

import time

import pytest
import torch
from diffusers.models.attention_dispatch import _AttentionBackendRegistry as dispatch_registry

from rollout import EngineConfig, RolloutEngine
from rollout.engine.config_check import problems_without_model
from rollout.pipelines.attention import (
    attention_backend_problem,
    attention_processors,
    dispatches_attention,
    usable_backends,
)
from rollout.pipelines.loading import load_adapter
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs
from tests.families import FAMILIES

pytestmark = pytest.mark.timeout(180)

# On the CPU: "native" is diffusers' default (torch's scaled_dot_product_attention, which picks a
# fused CPU kernel); "_native_math" holds torch to its reference math kernel, which rounds otherwise.
OTHER_CPU_BACKEND = "_native_math"
BACKENDS = {"uni": {"executor": "uni"}, "mp": {"executor": "mp", "num_workers": 2}}
PROMPTS = ["a red square", "a blue circle"]


def backends_in(adapter) -> set:
    """The backends the attention processors of `adapter`'s denoisers dispatch to."""
    return {
        processor._attention_backend
        for module in adapter.denoisers.values()
        for processor in attention_processors(module)
    }


def backends_of(worker) -> set:
    """On a worker: `backends_in` its adapter."""
    return backends_in(worker.adapter)


def _params(cfg: bool):
    return FAMILIES["flux"].params(cfg=cfg, num_inference_steps=4, num_samples=2, seed=3, sampler="flow_sde")


@pytest.fixture(scope="module")
def flux(tiny_models) -> str:
    return tiny_models("flux")


@pytest.fixture(scope="module")
def default_outputs(flux):
    """Samples of the default backend, CFG on and off: what every backend is compared with."""
    with RolloutEngine(EngineConfig(model=flux)) as engine:
        return {cfg: engine.generate(PROMPTS, _params(cfg)) for cfg in (True, False)}


@pytest.mark.parametrize("backend", ["uni", pytest.param("mp", marks=pytest.mark.slow)])  # mp: 22 s
def test_another_backend_samples_as_the_default_and_rescores_with_the_trainers_copy(flux, default_outputs, backend):
    config = EngineConfig(model=flux, attention_backend=OTHER_CPU_BACKEND, **BACKENDS[backend])
    with RolloutEngine(config) as engine:
        assert engine.collective_rpc(backends_of) == [{OTHER_CPU_BACKEND}] * config.num_workers
        outputs = {cfg: engine.generate(PROMPTS, _params(cfg)) for cfg in (True, False)}
    trainer = load_adapter(flux, attention_backend=OTHER_CPU_BACKEND)
    assert backends_in(trainer) == {OTHER_CPU_BACKEND}
    for cfg in (True, False):
        for got, want in zip(outputs[cfg], default_outputs[cfg], strict=True):
            # Another kernel: another rounding (measured ~1e-6), within the contract's bound.
            assert (got.trajectory.latents.stack() - want.trajectory.latents.stack()).abs().max() < 1e-5
            assert (got.trajectory.log_probs - want.trajectory.log_probs).abs().max() < 1e-5
            ratio = (recompute_log_probs(trainer, got.trajectory) - got.trajectory.log_probs).abs().max()
            assert ratio < RATIO_TOLERANCE


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_name_diffusers_does_not_know_is_refused_before_workers_start(flux, backend):
    start = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        RolloutEngine(EngineConfig(model=flux, attention_backend="flash_attention", **BACKENDS[backend]))
    message = str(refused.value)
    assert message.startswith("invalid EngineConfig: attention_backend 'flash_attention' is not one of diffusers'")
    assert "choose None (diffusers' default) or one of: " in message
    for works in ("native", OTHER_CPU_BACKEND):
        assert works in message.split("one of: ")[1].split(", ")
    assert time.perf_counter() - start < 10  # no worker loaded a model


def test_a_kernel_that_needs_cuda_or_a_missing_package_is_refused_on_the_cpu(flux):
    with pytest.raises(ValueError) as refused:
        RolloutEngine(EngineConfig(model=flux, attention_backend="_native_efficient", executor="mp", num_workers=2))
    message = str(refused.value)
    assert "attention_backend '_native_efficient' cannot run on cpu in float32" in message
    assert "_native_efficient" not in message.split("one of: ")[1].split(", ")
    # flash-attn is not installed here: diffusers' own requirement check says what to install.
    problem = attention_backend_problem("flash", "cpu", torch.float32)
    assert problem.startswith("attention_backend 'flash' cannot run here") and "flash-attn" in problem
    hub = attention_backend_problem("flash_hub", "cpu", torch.float32)
    assert "Hugging Face Hub" in hub and "nothing is downloaded" in hub


def test_a_cuda_device_is_checked_without_touching_it():
    # A bfloat16/float16-only kernel with float32 weights is refused by diffusers' registered constraint.
    problem = attention_backend_problem("_native_cudnn", "cuda", torch.float32)
    assert problem == (
        "attention_backend '_native_cudnn' cannot run on cuda in float32: Query, key, and value must be either "
        "bfloat16 or float16."
    )
    assert attention_backend_problem("_native_cudnn", "cuda", torch.bfloat16) is None
    assert "_native_cudnn" not in usable_backends("cpu", torch.float32)


def test_a_backend_without_context_parallelism_is_refused_with_sequence_parallel():
    problems = problems_without_model(
        executor="mp", num_workers=2, sequence_parallel=2, attention_backend=OTHER_CPU_BACKEND
    )
    assert len(problems) == 1 and "does not support diffusers' context parallelism" in problems[0]
    assert problems_without_model(executor="mp", num_workers=2, sequence_parallel=2, attention_backend="native") == []


def test_sd3_whose_attention_skips_the_dispatcher_is_refused_not_ignored(tiny_models):
    sd3 = tiny_models("sd3")
    with pytest.raises(ValueError, match="cannot apply to StableDiffusion3Pipeline: its transformer's attention"):
        RolloutEngine(EngineConfig(model=sd3, attention_backend="native"))
    with pytest.raises(ValueError, match=r"JointAttnProcessor2_0 call torch's attention directly"):
        load_adapter(sd3, attention_backend="native")


def test_a_backend_leaves_other_models_in_the_process_on_theirs(flux, default_outputs):
    """diffusers' set_attention_backend also sets the process's active backend: a uni engine with
    another kernel must not move a default engine (or a trainer's copy) in the same process."""
    before = dispatch_registry.get_active_backend()[0]
    with RolloutEngine(EngineConfig(model=flux, attention_backend=OTHER_CPU_BACKEND)):
        assert dispatch_registry.get_active_backend()[0] == before
    with RolloutEngine(EngineConfig(model=flux)) as engine:
        outputs = engine.generate(PROMPTS, _params(True))
    for got, want in zip(outputs, default_outputs[True], strict=True):
        assert torch.equal(got.trajectory.latents.stack(), want.trajectory.latents.stack())


def test_lora_policy_takes_the_backend(flux):
    from trainers_adapters.policy.lora_policy import LoraPolicy

    policy = LoraPolicy(flux, {"r": 2, "lora_alpha": 2}, attention_backend=OTHER_CPU_BACKEND)
    assert backends_in(policy.adapter) == {OTHER_CPU_BACKEND}
    with pytest.raises(ValueError, match="not one of diffusers' attention backends"):
        LoraPolicy(flux, {"r": 2, "lora_alpha": 2}, attention_backend="fast")


@pytest.mark.parametrize(
    "family", [pytest.param(name, marks=[] if name in ("sd3", "flux") else pytest.mark.slow) for name in FAMILIES]
)
def test_each_familys_declaration_matches_its_attention_processors(tiny_models, family):
    adapter = load_adapter(tiny_models(family))
    declared = FAMILIES[family].attention_dispatcher
    assert [dispatches_attention(module) for module in adapter.denoisers.values()] == [declared] * len(
        adapter.denoisers
    )


def test_the_recipes_engine_section_and_the_servers_flags_take_it():
    from recipes.config import EngineSection
    from rollout.serve.__main__ import parse_args

    section = EngineSection(attention_backend=OTHER_CPU_BACKEND)
    assert section.to_engine_config("m").attention_backend == OTHER_CPU_BACKEND
    assert EngineSection().attention_backend is None
    assert section.class_problems() == []
    (problem,) = EngineSection(attention_backend="_native_efficient").class_problems()
    assert problem.startswith("attention_backend '_native_efficient' cannot run on cpu in float32")
    assert parse_args(["--model", "m", "--no-auth", "--attention-backend", OTHER_CPU_BACKEND]).attention_backend == (
        OTHER_CPU_BACKEND
    )
    assert parse_args(["--model", "m", "--no-auth"]).attention_backend is None
    with pytest.raises(ValueError, match="attention_backend must be None or the name of one of diffusers'"):
        EngineSection(attention_backend="")
