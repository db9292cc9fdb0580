"""GRPO on Qwen-Image-Edit rollouts starts at ratio 1 (the trainer re-scores with the trajectories'
encoded prompts and reference images, never re-encoding), and the LoRA the policy trains loads in
the edit pipeline's `load_lora_weights` and gives the engine's edit from the same initial latents.
Slow: each rollout encodes megapixel reference images."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from rollout.rescoring import RATIO_TOLERANCE
from tests.families import FAMILIES, input_image
from trainers_adapters.grpo_trainer import GRPOSettings, grpo_step
from trainers_adapters.lora_policy import LoraPolicy
from trainers_adapters.rewarded_rollout import generate_with_rewards
from trainers_adapters.rewards import colour_edit

pytestmark = pytest.mark.timeout(600)

LORA = {"r": 4, "lora_alpha": 8}  # no target_modules: the family's default targets


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=pytest.mark.slow) for name in ("qwen_image_edit", "qwen_image_edit_plus")],
)
def test_an_edit_policy_trains_from_ratio_one_and_its_lora_reproduces_the_engine_in_diffusers(
    tiny_models, tmp_path, name
):

    family = FAMILIES[name]
    path = tiny_models(name)
    torch.manual_seed(0)
    policy = LoraPolicy(path, LORA)
    image = input_image(2, 24, 40)
    with RolloutEngine(EngineConfig(model=path)) as engine, ThreadPoolExecutor(1) as pool:
        policy.push(engine)
        params = family.params(cfg=True, num_inference_steps=3, num_samples=3, seed=3, lora=policy.name)
        images = [[image], [input_image(3, 24, 40)]]
        rollout = generate_with_rewards(
            engine, ["make it red", "make it red"], params, colour_edit, pool, images=images
        )
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        stats = grpo_step(policy, optimizer, rollout, GRPOSettings(), torch.Generator().manual_seed(0))
        assert stats.log_ratio_before_update < RATIO_TOLERANCE
        with torch.no_grad():  # further from the base than one step takes it, for a clear comparison
            for parameter in policy.parameters():
                parameter.add_(0.2 * torch.randn_like(parameter))
        folder = policy.save(tmp_path / "lora").parent
        engine.load_lora("trained", str(folder))
        ode = family.params(sampler="ode", num_inference_steps=3, seed=0)
        (with_lora,) = engine.generate(
            "make it red",
            family.params(sampler="ode", num_inference_steps=3, seed=0, lora="trained"),
            images=[[image]],
        )
        (base,) = engine.generate("make it red", ode, images=[[image]])

    pipeline = family.diffusers_pipeline(path)  # the real edit pipeline; its processor given
    pipeline.load_lora_weights(folder)
    latents = with_lora.trajectory.latents.stack()
    call = {"num_inference_steps": 3, "height": 32, "width": 32, **family.no_cfg}
    call |= family.pipeline_inputs({"images": [[image]]})
    reference = pipeline(prompt="make it red", latents=latents[0][None].clone(), output_type="latent", **call).images
    assert (latents[-1] - reference[0]).abs().max() < 1e-4
    assert (latents[-1] - base.trajectory.latents[-1]).abs().max() > 1e-2  # the adapter changed the edit
