"""Qwen-Image 2.1: what its conditioning adds over Qwen-Image. A prompt's length sets where the
image's tokens sit in the block-causal stream (their rotary positions start after the text), so
rows of prompts of different lengths run apart, unpadded, and each equals the pipeline's own run of
its prompt; the samples of a prompt share one encoding; guidance is plain CFG, not Qwen-Image's
norm-rescaled one."""

from __future__ import annotations

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from tests.families import FAMILIES

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["a red square", "a much longer prompt about a blue circle on a green field"]


@pytest.fixture(scope="module")
def setup(tiny_models):
    family = FAMILIES["qwen_image21"]
    path = tiny_models(family.name)
    with RolloutEngine(EngineConfig(model=path)) as engine:
        yield family, path, engine


@pytest.mark.slow
def test_prompts_of_different_lengths_in_one_batch_each_equal_the_pipeline(setup):
    family, path, engine = setup
    params = family.params(cfg=True, sampler="ode", num_inference_steps=3, num_samples=2, seed=0)
    outputs = engine.generate(PROMPTS, params)
    conditions = [o.trajectory.condition for o in outputs]
    lengths = {c.prompt.prompt_embeds.shape[0] for c in conditions}
    assert len(lengths) == 2  # the two prompts encode to different lengths, unpadded
    assert conditions[0].prompt is conditions[1].prompt and conditions[2].prompt is conditions[3].prompt
    assert all(c.negative is conditions[0].negative for c in conditions)  # one " " for every sample
    pipeline = family.diffusers_pipeline(path)
    for output in outputs[::2]:
        latents = output.trajectory.latents
        result = pipeline(
            prompt=output.prompt,
            latents=latents[0][None].clone(),
            num_inference_steps=3,
            height=32,
            width=32,
            output_type="latent",
            **family.cfg,
        ).images
        assert (result[0] - latents[-1]).abs().max().item() < 1e-4


def test_guidance_is_plain_cfg_without_qwen_images_rescale(setup):
    family, _, engine = setup
    adapter_class = family.adapter
    cond, uncond = torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0, 0.0]])
    combined = adapter_class.combine_cfg(None, cond, uncond, torch.tensor(4.0))
    assert torch.equal(combined, uncond + 4.0 * (cond - uncond))  # Qwen-Image's would rescale to norm 5
