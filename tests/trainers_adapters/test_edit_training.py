"""GRPO on edit rollouts (FLUX.1 Kontext, Qwen-Image-Edit, Qwen-Image-Edit-Plus) starts at ratio 1
(the trainer re-scores with the trajectories' encoded prompts and input images, never re-encoding),
and the LoRA the policy trains loads in the family's edit pipeline (`load_lora_weights`) and gives
the engine's edit from the same initial latents. Slow: FLUX.1 Kontext's runs beside the other
families' matrix tests there, and every Qwen-Image edit encodes megapixel reference images."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from rollout.rescoring import RATIO_TOLERANCE
from tests.families import FAMILIES, input_image
from trainers_adapters.grpo.trainer import GRPOSettings, grpo_step
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.rewards.builtin import colour_edit
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards

pytestmark = pytest.mark.timeout(600)

LORA = {"r": 4, "lora_alpha": 8}  # no target_modules: the family's default targets
INPUT_SIZE = (24, 40)  # not square, so an output made at its size shows it
# Per family: the (height, width) its edits are made at. FLUX.1 Kontext's requests set none, so its
# edit is made at the input's size (as its pipeline makes one with max_area at that size); the
# Qwen-Image edit pipelines' default is a megapixel, so theirs ask for the tiny 32x32.
OUTPUT_SIZE = {"flux_kontext": None, "qwen_image_edit": (32, 32), "qwen_image_edit_plus": (32, 32)}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) for name in OUTPUT_SIZE])
def test_an_edit_policy_trains_from_ratio_one_and_its_lora_reproduces_the_engine_in_diffusers(
    tiny_models, tmp_path, name
):
    family = FAMILIES[name]
    path = tiny_models(name)
    height, width = OUTPUT_SIZE[name] or INPUT_SIZE
    size = {"height": None, "width": None} if OUTPUT_SIZE[name] is None else {"height": height, "width": width}
    torch.manual_seed(0)
    policy = LoraPolicy(path, LORA)
    image = input_image(2, *INPUT_SIZE)
    with RolloutEngine(EngineConfig(model=path)) as engine, ThreadPoolExecutor(1) as pool:
        policy.push(engine)
        params = family.params(cfg=True, num_inference_steps=3, num_samples=3, seed=3, lora=policy.name, **size)
        images = [[image], [input_image(3, *INPUT_SIZE)]]
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
        ode = family.params(sampler="ode", num_inference_steps=3, seed=0, **size)
        (with_lora,) = engine.generate("make it red", dataclasses.replace(ode, lora="trained"), images=[[image]])
        (base,) = engine.generate("make it red", ode, images=[[image]])
    assert with_lora.image.shape == (3, height, width)

    pipeline = family.diffusers_pipeline(path)  # the real edit pipeline (the Qwen ones' processor given)
    pipeline.load_lora_weights(folder)
    latents = with_lora.trajectory.latents.stack()
    call = {"num_inference_steps": 3, "height": height, "width": width, **family.no_cfg}
    call |= family.pipeline_inputs({"images": [[image]]}, height, width)
    reference = pipeline(prompt="make it red", latents=latents[0][None].clone(), output_type="latent", **call).images
    assert (latents[-1] - reference[0]).abs().max() < 1e-4
    assert (latents[-1] - base.trajectory.latents[-1]).abs().max() > 1e-2  # the adapter changed the edit
