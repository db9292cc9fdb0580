"""The trainer side takes any family through the same adapter: GRPO and DPO updates on FLUX.1,
Qwen-Image and Z-Image rollouts (packed latents, CFG with a negative prompt, unpadded caption lists),
and a LoRA the policy trains on FLUX.1 or Z-Image loads into its pipeline's `load_lora_weights` and
reproduces the engine's samples."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.rescoring import RATIO_TOLERANCE
from tests.families import FAMILIES
from trainers_adapters.dpo.trainer import DPOSettings, dpo_step
from trainers_adapters.grpo.trainer import GRPOSettings, grpo_step
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards

pytestmark = pytest.mark.timeout(180)

LORA = {"r": 4, "lora_alpha": 8}  # no target_modules: the family's default targets


# FLUX.2 [klein]'s and [dev]'s, Z-Image's and Qwen-Image 2.1's run in the slow suite, as their matrix
# tests do (tests/families.py).
@pytest.fixture(
    scope="module",
    params=["flux", "qwen_image"]
    + [pytest.param(name, marks=pytest.mark.slow) for name in ("flux2_klein", "zimage", "qwen_image21", "flux2_dev")],
)
def family_engine(request, tiny_models):
    family = FAMILIES[request.param]
    path = tiny_models(family.name)
    with RolloutEngine(EngineConfig(model=path)) as engine:
        yield family, path, engine


def _policy_and_rollout(family_engine, cfg: bool):
    """A fresh policy (seed 0) pushed to the family's engine, and a rewarded rollout of 2 prompts x 4
    samples under it."""
    family, path, engine = family_engine
    torch.manual_seed(0)
    policy = LoraPolicy(path, LORA)
    policy.push(engine)
    params = family.params(cfg=cfg, num_inference_steps=4, num_samples=4, seed=3, lora=policy.name)
    with ThreadPoolExecutor(1) as pool:
        rollout = generate_with_rewards(engine, ["a red square", "a blue circle"], params, colour_target, pool)
    return policy, rollout


def test_grpo_update_starts_at_ratio_one(family_engine):
    engine = family_engine[2]
    policy, rollout = _policy_and_rollout(family_engine, cfg=True)
    before = policy.lora_state()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    stats = grpo_step(policy, optimizer, rollout, GRPOSettings(kl_beta=0.01), torch.Generator().manual_seed(0))
    assert stats.log_ratio_before_update < RATIO_TOLERANCE
    assert stats.num_transitions == 8 * 4
    assert any(not torch.equal(before[k], v) for k, v in policy.lora_state().items())
    engine.unload_lora(policy.name)


def test_dpo_update_starts_at_log_two(family_engine):
    engine = family_engine[2]
    policy, rollout = _policy_and_rollout(family_engine, cfg=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    stats = dpo_step(policy, optimizer, rollout, DPOSettings(), torch.Generator().manual_seed(0))
    assert stats.num_pairs == 2
    assert stats.loss == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as the reference
    assert stats.grad_norm > 0
    engine.unload_lora(policy.name)


# Per family: the pipeline's call with the engine's guidance (FLUX.1-dev's distilled 3.5; Z-Image's
# CFG, its default 5 with the negative prompt "", so the LoRA acts on both halves).
LORA_REPLAY = {
    "flux": {"guidance_scale": 3.5},
    "zimage": {"guidance_scale": 5.0},
}


@pytest.mark.parametrize("name", ["flux", pytest.param("zimage", marks=pytest.mark.slow)])
def test_a_lora_from_the_policy_reproduces_the_engine_in_diffusers(tiny_models, tmp_path, name):
    import diffusers

    family = FAMILIES[name]
    path = tiny_models(name)
    torch.manual_seed(0)
    policy = LoraPolicy(path, LORA)
    with torch.no_grad():  # a trained-looking adapter: LoRA B starts at zero
        for parameter in policy.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    folder = policy.save(tmp_path / "lora").parent
    guidance = LORA_REPLAY[name]
    params = family.params(sampler="ode", num_inference_steps=4, seed=0, lora="trained", **guidance)
    with RolloutEngine(EngineConfig(model=path)) as engine:
        engine.load_lora("trained", str(folder))
        (with_lora,) = engine.generate("a red square", params)
        engine.unload_lora("trained")
        (base,) = engine.generate(
            "a red square", family.params(sampler="ode", num_inference_steps=4, seed=0, **guidance)
        )

    pipeline = getattr(diffusers, family.pipeline_class).from_pretrained(path)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(folder)
    latents = with_lora.trajectory.latents.stack()
    call = {"num_inference_steps": 4, "height": 32, "width": 32, "output_type": "latent", **guidance}
    reference = pipeline("a red square", latents=latents[0][None].clone(), **call).images
    assert (latents[-1] - reference[0]).abs().max() < 1e-4
    assert (latents[-1] - base.trajectory.latents[-1]).abs().max() > 1e-2  # the adapter changed the samples


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg, edit",
    [(True, False), (False, False), (True, True), (False, True)],
    ids=["cfg", "no-cfg", "edit-cfg", "edit"],
)
def test_a_flux2_klein_lora_from_the_policy_reproduces_the_engine_in_diffusers(tiny_models, tmp_path, cfg, edit):
    """FLUX.2 [klein]: the policy's default targets (double and single blocks) load with
    `Flux2KleinPipeline.load_lora_weights`, guided (CFG against "") and not, text-to-image and on
    an edit with reference images (their tokens go through the adapted blocks too)."""
    from diffusers import Flux2KleinPipeline

    from tests.rollout.pipelines.test_parity import as_latent_output

    family = FAMILIES["flux2_klein"]
    path = tiny_models("flux2_klein")
    torch.manual_seed(0)
    policy = LoraPolicy(path, LORA)
    assert any("single_transformer_blocks" in key for key in policy.lora_state())
    with torch.no_grad():  # a trained-looking adapter: LoRA B starts at zero
        for parameter in policy.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    folder = policy.save(tmp_path / "lora").parent
    params = family.params(cfg=cfg, sampler="ode", num_inference_steps=4, seed=0, lora="trained")
    inputs = family.inputs(1) if edit else {}  # one 64x64 reference image
    with RolloutEngine(EngineConfig(model=path)) as engine:
        engine.load_lora("trained", str(folder))
        (with_lora,) = engine.generate("a red square", params, **inputs)
        engine.unload_lora("trained")
        base_params = family.params(cfg=cfg, sampler="ode", num_inference_steps=4, seed=0)
        (base,) = engine.generate("a red square", base_params, **inputs)
    assert (with_lora.trajectory.condition.images is not None) == edit

    pipeline = Flux2KleinPipeline.from_pretrained(path)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(folder)
    latents = with_lora.trajectory.latents.stack()
    call = {"num_inference_steps": 4, "height": 32, "width": 32, "output_type": "latent"}
    call |= family.cfg if cfg else family.no_cfg
    call |= family.pipeline_inputs(inputs or None)
    reference = pipeline(prompt="a red square", latents=latents[0][None].clone(), **call).images
    assert (as_latent_output(family, pipeline, latents[-1][None]) - reference).abs().max() < 1e-4
    assert (latents[-1] - base.trajectory.latents[-1]).abs().max() > 1e-2  # the adapter changed the samples


def test_a_wan22_policy_trains_both_experts_from_ratio_one_and_saves_both(tiny_models, tmp_path):
    from tests.families import VIDEO_FAMILIES
    from trainers_adapters.rewards.builtin import colour_agreement

    family = VIDEO_FAMILIES["wan22"]
    path = tiny_models("wan22")
    torch.manual_seed(0)
    policy = LoraPolicy(path, LORA | {"init_lora_weights": False})  # random B: both experts' adapters act
    assert set(policy.denoisers) == {"transformer", "transformer_2"}
    with RolloutEngine(EngineConfig(model=path)) as engine, ThreadPoolExecutor(1) as pool:
        policy.push(engine)
        assert engine.lora_modules(policy.name) == 2 * 4 * 2  # q, k, v, out of 2 attentions, on each expert
        params = family.params(cfg=True, num_inference_steps=4, num_samples=3, seed=2, lora=policy.name)
        rollout = generate_with_rewards(engine, ["a calm lake", "a still room"], params, colour_agreement, pool)
        assert rollout.outputs[0].video.shape == (9, 3, 32, 32)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        before = policy.lora_state()
        stats = grpo_step(policy, optimizer, rollout, GRPOSettings(), torch.Generator().manual_seed(0))
        assert stats.log_ratio_before_update < RATIO_TOLERANCE  # steps on both sides of the boundary, both experts
        after = policy.lora_state()
        for prefix in ("", "transformer_2."):
            changed = [k for k in before if k.startswith(prefix) and not torch.equal(before[k], after[k])]
            assert changed, f"no {prefix or 'transformer.'} tensor moved"
        folder = policy.save(tmp_path / "lora")
        engine.load_lora("saved", str(folder.parent))
        policy.push(engine)
        p = family.params(num_inference_steps=3, seed=1)
        saved = engine.generate("x", SamplingParams(**{**p.__dict__, "lora": "saved"}))
        pushed = engine.generate("x", SamplingParams(**{**p.__dict__, "lora": policy.name}))
        assert torch.equal(saved[0].trajectory.latents.stack(), pushed[0].trajectory.latents.stack())
