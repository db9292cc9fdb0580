"""Per-step records (x̂₀, the transition's mean and std), `record_steps` and the output forms."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs
from rollout.samplers import get_sampler

pytestmark = pytest.mark.timeout(120)

RECORDED = SamplingParams(
    num_inference_steps=5, num_samples=2, seed=3, sde_window=(1, 4), record=("x0", "mean", "std"), guidance_scale=3.0
)


def test_records_equal_the_sampler_and_a_direct_velocity(engine, trainer_adapter):
    for output in engine.generate("a red square", RECORDED):
        t = output.trajectory
        assert set(t.records) == {"x0", "mean", "std"}
        for i in range(t.num_steps):
            x, sigma, sigma_next = t.latents[i][None], t.sigmas[i : i + 1], t.sigmas[i + 1 : i + 2]
            velocity = trainer_adapter.predict_velocity(
                x, sigma, [t.condition], height=t.height, width=t.width, guidance_scale=t.guidance_scale
            )
            rule = get_sampler(t.sampler if t.sde_mask[i] else "ode")
            step = rule(x, velocity, sigma, sigma_next, t.noise_level, prev_sample=t.latents[i + 1][None])
            assert (t.records["x0"][i] - (x[0] - sigma * velocity[0])).abs().max() < 1e-5
            assert (t.records["mean"][i] - step.mean[0]).abs().max() < 1e-5
            assert torch.allclose(t.records["std"][i], step.std[0].reshape(()), atol=1e-7)
            assert (t.records["std"][i] > 0) == bool(t.sde_mask[i])  # ODE steps: std 0, mean = x_{i+1}
        ode_steps = [i for i in range(t.num_steps) if not t.sde_mask[i]]
        assert all(torch.equal(t.records["mean"][i], t.latents[i + 1]) for i in ode_steps)


def test_records_are_off_by_default_and_change_nothing_else(engine):
    plain = SamplingParams(**{**RECORDED.__dict__, "record": ()})
    with_records = engine.generate("a red square", RECORDED)
    without = engine.generate("a red square", plain)
    for a, b in zip(with_records, without, strict=True):
        assert b.trajectory.records == {}
        assert torch.equal(a.trajectory.latents.stack(), b.trajectory.latents.stack())
        assert torch.equal(a.trajectory.log_probs, b.trajectory.log_probs)


def test_record_steps_keep_only_those_steps_and_they_still_rescore(engine, trainer_adapter):
    params = SamplingParams(num_inference_steps=6, seed=4, record=("x0",), record_steps=(1, 4))
    (full,) = engine.generate("x", SamplingParams(**{**params.__dict__, "record_steps": None}))
    (kept,) = engine.generate("x", params)
    t = kept.trajectory
    assert t.latents.positions.tolist() == [1, 2, 4, 5, 6]  # around steps 1 and 4, and the final latents
    assert t.records["x0"].positions.tolist() == [1, 4]
    # Step 5's transition (x_5 -> x_6) is whole too, so a trainer can score it.
    assert t.kept_steps.tolist() == [1, 4, 5] and t.scorable_steps.tolist() == [1, 4, 5]
    for position in (1, 2, 4, 5, 6, -1):
        assert torch.equal(t.latents[position], full.trajectory.latents[position])
    assert torch.equal(t.records["x0"][4], full.trajectory.records["x0"][4])
    with pytest.raises(IndexError, match="position 3 of this trajectory was not kept .* widen record_steps"):
        t.latents[3]
    assert torch.equal(t.log_probs, full.trajectory.log_probs)  # the scalars stay for every step
    rescored = recompute_log_probs(trainer_adapter, t)
    assert (rescored[[1, 4, 5]] - t.log_probs[[1, 4, 5]]).abs().max() < RATIO_TOLERANCE
    assert rescored[[0, 2, 3]].eq(0).all()
    assert t.latents.nbytes < 0.75 * full.trajectory.latents.nbytes


def test_latent_output_skips_the_decode_and_gives_the_same_latents(engine):
    base = {"num_inference_steps": 3, "num_samples": 2, "seed": 9}
    images = engine.generate("x", SamplingParams(**base))
    latents = engine.generate("x", SamplingParams(**base, output_type="latent", return_trajectory=False))
    nothing = engine.generate("x", SamplingParams(**base, output_type="none"))
    for image, latent, none in zip(images, latents, nothing, strict=True):
        assert image.latents is None and image.image is not None
        assert latent.image is None and latent.trajectory is None
        assert torch.equal(latent.latents, image.trajectory.latents[-1])
        assert none.image is None and none.latents is None
        assert torch.equal(none.trajectory.latents[-1], image.trajectory.latents[-1])


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match=r"record must be a tuple of names from \('x0', 'mean', 'std'\)"):
        SamplingParams(record=("x0", "velocity"))
    with pytest.raises(ValueError, match="output_type must be one of"):
        SamplingParams(output_type="pil")
    with pytest.raises(ValueError, match=r"record_steps must be step indices in \[0, 10\)"):
        SamplingParams(record_steps=(10,))
    with pytest.raises(ValueError, match=r"sigmas has 3 entries but num_inference_steps is 10; .*=3\)"):
        SamplingParams(sigmas=(1.0, 0.5, 0.2))
    with pytest.raises(ValueError, match=r"sigmas must decrease strictly and lie in \[1e-05, 1\]"):
        SamplingParams(num_inference_steps=3, sigmas=(1.0, 0.5, 0.5))
    with pytest.raises(ValueError, match=r"sigmas must decrease strictly"):
        SamplingParams(num_inference_steps=2, sigmas=(1.2, 0.5))
    with pytest.raises(ValueError, match=r"\[1e-05, 1\] \(below 1e-05 a step's noise is lost to float32 rounding"):
        SamplingParams(num_inference_steps=1, sigmas=(1e-30,))  # once a NaN log-prob
    assert SamplingParams(num_inference_steps=2, sigmas=[1.0, 0.5]).sigmas == (1.0, 0.5)  # lists from YAML
