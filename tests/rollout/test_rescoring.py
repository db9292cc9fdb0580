"""Re-scoring a stored trajectory with a fresh velocity gives ratio 1 (|log-ratio| < 1e-5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.loading import load_adapter
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs
from tests.families import FAMILIES, matrix

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=matrix())
def family_engine(request, tiny_models):
    """(family, engine, a separate copy of the model for re-scoring) per family."""
    family = FAMILIES[request.param]
    path = tiny_models(family.name)
    with RolloutEngine(EngineConfig(model=path)) as engine:
        yield family, engine, load_adapter(path)


@pytest.mark.parametrize("sampler", ["flow_sde", "cps", "dance_sde"])
def test_recomputed_log_probs_equal_rollout_log_probs(family_engine, sampler):
    family, engine, trainer_adapter = family_engine
    # One prompt with classifier-free guidance, one without, in the same batches.
    params = [
        family.params(cfg=cfg, sampler=sampler, num_inference_steps=5, noise_level=0.5, num_samples=2, seed=11)
        for cfg in (True, False)
    ]
    # An edit family's two prompts edit images of different sizes (batched apart).
    inputs = family.inputs(sizes=family.edit_sizes)
    outputs = engine.generate(["a red square", "a blue circle in the sky"], params, **inputs)
    for output in outputs:
        trajectory = output.trajectory
        assert trajectory.sde_mask.any()
        recomputed = recompute_log_probs(trainer_adapter, trajectory)
        log_ratio = (recomputed - trajectory.log_probs)[trajectory.sde_mask]
        assert log_ratio.abs().max() < RATIO_TOLERANCE, (
            f"{family.name} {sampler}: max |log-ratio| {log_ratio.abs().max():.2e}"
        )
        assert torch.all(trajectory.log_probs[~trajectory.sde_mask] == 0)


def test_rescoring_detects_a_different_policy(engine, trainer_adapter):
    (output,) = engine.generate("a red square", SamplingParams(num_inference_steps=4, seed=5))
    perturbed = output.trajectory
    perturbed.guidance_scale = perturbed.guidance_scale + 2.0  # a different velocity field
    log_ratio = recompute_log_probs(trainer_adapter, perturbed) - output.trajectory.log_probs
    assert log_ratio.abs().max() > 1e-3


def test_a_trajectory_sampled_at_another_lora_scale_is_refused_not_rescored_at_full_strength(engine, trainer_adapter):
    (output,) = engine.generate("a red square", SamplingParams(num_inference_steps=3, seed=5))
    half = dataclasses.replace(output.trajectory, lora_scale=0.5)
    with pytest.raises(ValueError, match=r"lora_scale=0.5.*pass lora_scale=0.5"):
        recompute_log_probs(trainer_adapter, half)
    # Said to run at that scale, it is scored (here the model has no LoRA, so the numbers are the base's).
    log_ratio = recompute_log_probs(trainer_adapter, half, lora_scale=0.5) - half.log_probs
    assert log_ratio.abs().max() < RATIO_TOLERANCE
    assert (recompute_log_probs(trainer_adapter, output.trajectory) - half.log_probs).abs().max() < RATIO_TOLERANCE


def test_trajectory_layout(engine):
    params = SamplingParams(num_inference_steps=5, sde_window=(1, 3), seed=0)
    (output,) = engine.generate("a red square", params)
    t = output.trajectory
    assert t.latents.stack().shape == (6, 4, 16, 16) and t.latents.stack().dtype == torch.float32
    assert t.log_probs.shape == (5,) and t.log_probs.dtype == torch.float32
    assert t.sigmas.shape == (6,) and t.sigmas[-1] == 0 and t.sigmas[0] == 1
    assert t.timesteps.shape == (5,)
    assert t.sde_mask.tolist() == [False, True, True, False, False]
    assert torch.all(t.log_probs[[0, 3, 4]] == 0) and torch.all(t.log_probs[[1, 2]] != 0)
    assert t.condition.prompt.prompt_embeds.dtype == torch.float32 and t.condition.negative is not None
    assert output.image.shape == (3, 32, 32) and output.image.dtype == torch.uint8
