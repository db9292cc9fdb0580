"""FLUX.2 [dev] (Flux2Pipeline): its guidance is the distilled transformer's input (one forward per
row, the scale changes the prediction, no negative prompt), and an edit from two reference images
of different sizes is the pipeline's own."""

from __future__ import annotations

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from rollout.input_images import InputImages
from tests.families import FAMILIES, input_image
from tests.rollout.pipelines.test_parity import as_latent_output

pytestmark = pytest.mark.timeout(180)

FLUX2_DEV = FAMILIES["flux2_dev"]
TWO_IMAGES = [input_image(0, 64, 64), input_image(1, 72, 96)]


@pytest.fixture(scope="module")
def setup(tiny_models):
    path = tiny_models("flux2_dev")
    with RolloutEngine(EngineConfig(model=path)) as engine:
        yield engine, FLUX2_DEV.diffusers_pipeline(path)


@pytest.mark.slow
def test_guidance_is_a_transformer_input_in_one_pass(setup):
    engine, _ = setup
    assert engine.model_spec.cfg_field is None  # no unconditional pass
    outputs = {}
    for scale in (1.0, 4.0):
        params = FLUX2_DEV.params(sampler="ode", num_inference_steps=2, seed=0, guidance_scale=scale)
        (outputs[scale],) = engine.generate("a red square", params)
    assert not torch.equal(outputs[1.0].trajectory.latents[-1], outputs[4.0].trajectory.latents[-1])
    with pytest.raises(ValueError, match="negative_prompt"):
        engine.generate("a red square", FLUX2_DEV.params(num_inference_steps=2, negative_prompt="ugly"))


@pytest.mark.slow
def test_an_edit_with_two_references_is_the_pipelines(setup):
    engine, pipeline = setup
    params = FLUX2_DEV.params(cfg=True, sampler="ode", num_inference_steps=2, seed=1)
    (output,) = engine.generate("make it red", params, images=[TWO_IMAGES])
    reference = pipeline(
        image=InputImages.of(TWO_IMAGES).pil(),
        prompt="make it red",
        latents=output.trajectory.latents[0][None].clone(),
        num_inference_steps=2,
        height=32,
        width=32,
        output_type="latent",
        **FLUX2_DEV.cfg,
    ).images
    final = as_latent_output(FLUX2_DEV, pipeline, output.trajectory.latents[-1][None])
    assert (final - reference).abs().max() < 1e-4
