"""The engine's ODE path is diffusers' StableDiffusion3Pipeline, step for step."""

from __future__ import annotations

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from rollout import SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def diffusers_pipeline(tiny_model):
    pipeline = StableDiffusion3Pipeline.from_pretrained(
        tiny_model, text_encoder_3=None, tokenizer_3=None, local_files_only=True
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.mark.parametrize("guidance_scale", [4.5, 1.0])
def test_ode_rollout_equals_diffusers_pipeline(engine, diffusers_pipeline, guidance_scale):
    params = SamplingParams(sampler="ode", num_inference_steps=6, guidance_scale=guidance_scale, seed=3)
    (output,) = engine.generate("a red square", params)
    initial = output.trajectory.latents[0][None]

    reference = diffusers_pipeline(
        "a red square",
        latents=initial.clone(),
        guidance_scale=guidance_scale,
        num_inference_steps=6,
        output_type="latent",
    ).images
    assert (output.trajectory.latents[-1] - reference[0]).abs().max() < 1e-4

    images = diffusers_pipeline(
        "a red square", latents=initial.clone(), guidance_scale=guidance_scale, num_inference_steps=6, output_type="np"
    ).images
    reference_uint8 = torch.from_numpy((images[0] * 255).round().astype("uint8")).permute(2, 0, 1)
    assert (output.image.int() - reference_uint8.int()).abs().max() <= 1


def test_schedule_matches_diffusers(engine, diffusers_pipeline):
    (output,) = engine.generate("x", SamplingParams(sampler="ode", num_inference_steps=7, seed=0))
    diffusers_pipeline.scheduler.set_timesteps(7)
    assert torch.equal(output.trajectory.sigmas, diffusers_pipeline.scheduler.sigmas)
    assert torch.equal(output.trajectory.timesteps, diffusers_pipeline.scheduler.timesteps)
