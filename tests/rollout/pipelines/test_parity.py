"""The engine's ODE path is each family's own diffusers pipeline, step for step: the trajectory's
initial latents, passed to the pipeline as `latents=`, give the engine's final latents and image."""

from __future__ import annotations

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from tests.families import FAMILIES, matrix
from tests.rollout.pipelines.family_checks import pipeline_schedule

pytestmark = pytest.mark.timeout(120)


def as_latent_output(family, pipeline, latents: torch.Tensor) -> torch.Tensor:
    """Final latents [B, ...] in the `latents=` form, as the pipeline returns them with
    output_type="latent": the same form, but FLUX.2 [klein]'s undoes its VAE batch norm and 2x2
    patchify first (Flux2KleinPipeline.__call__ after the loop), and FLUX.2 [dev]'s returns the
    transformer's packed tokens [B, h*w, C*4] (Flux2Pipeline.__call__ returns them before unpacking)."""
    if family.name == "flux2_dev":
        return pipeline._pack_latents(latents)
    if family.name != "flux2_klein":
        return latents
    bn = pipeline.vae.bn
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipeline.vae.config.batch_norm_eps)
    return pipeline._unpatchify_latents(latents * std + bn.running_mean.view(1, -1, 1, 1))


def _required_inputs(family, engine) -> dict:
    """An input image per prompt where the family's pipeline requires one (the Qwen-Image edit
    pipelines), else nothing: these tests compare text-to-image schedules where there is one."""
    return family.inputs(1) if engine.model_spec.min_input_images else {}


@pytest.fixture(scope="module", params=matrix())
def family_setup(request, tiny_models):
    """(family, engine, the family's diffusers pipeline) on the same tiny folder."""
    family = FAMILIES[request.param]
    path = tiny_models(family.name)
    pipeline = family.diffusers_pipeline(path)  # the real pipeline; only an edit family's processor is given
    with RolloutEngine(EngineConfig(model=path)) as engine:
        yield family, engine, pipeline


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_ode_rollout_equals_diffusers_pipeline(family_setup, cfg):
    family, engine, pipeline = family_setup
    params = family.params(cfg=cfg, sampler="ode", num_inference_steps=6, seed=3)
    inputs = family.inputs(1)  # an edit family's input image
    (output,) = engine.generate("a red square", params, **inputs)
    initial = output.trajectory.latents[0][None]  # the pipeline's own `latents=` form
    guidance = family.cfg if cfg else family.no_cfg
    call = {"num_inference_steps": 6, "height": 32, "width": 32, **guidance, **family.pipeline_inputs(inputs)}
    if family.name == "sd3":
        call["guidance_scale"] = params.guidance_scale
    elif family.name == "qwen_image" and not cfg:
        call["true_cfg_scale"] = 1.0  # the pipeline's default (4.0) is off without a negative prompt anyway

    # prompt= by name: Flux2KleinPipeline's first argument is `image`.
    reference = pipeline(prompt="a red square", latents=initial.clone(), output_type="latent", **call).images
    final = as_latent_output(family, pipeline, output.trajectory.latents[-1][None])
    assert (final - reference).abs().max() < 1e-4

    images = pipeline(prompt="a red square", latents=initial.clone(), output_type="np", **call).images
    reference_uint8 = torch.from_numpy((images[0] * 255).round().astype("uint8")).permute(2, 0, 1)
    assert (output.image.int() - reference_uint8.int()).abs().max() <= 1


def test_schedule_matches_diffusers(family_setup):
    """Sigmas and timesteps as the pipeline sets them (FLUX.1 and Qwen-Image shift them by the
    image's token count, Qwen-Image stretches them to end at 0.02)."""
    family, engine, pipeline = family_setup
    inputs = _required_inputs(family, engine)
    (output,) = engine.generate("x", family.params(sampler="ode", num_inference_steps=7, seed=0), **inputs)
    call = {"guidance_scale": 1.0} if family.name == "sd3" else {}
    call |= {"num_inference_steps": 7, "height": 32, "width": 32, "output_type": "latent"}
    call |= family.pipeline_inputs(inputs)
    sigmas, timesteps = pipeline_schedule(pipeline, prompt="x", **call)
    assert torch.equal(output.trajectory.sigmas, sigmas)
    assert torch.equal(output.trajectory.timesteps, timesteps)


def test_sigmas_dictated_by_the_trainer_match_the_pipelines_sigmas_argument(family_setup):
    """`SamplingParams.sigmas` is the pipeline's `sigmas=`: the family's shift still applies, the
    schedule ends at 0, and the ODE path is the pipeline's."""
    family, engine, pipeline = family_setup
    sigmas = (1.0, 0.8, 0.45, 0.2)
    params = family.params(cfg=False, sampler="ode", num_inference_steps=4, seed=4, sigmas=sigmas)
    inputs = _required_inputs(family, engine)
    (output,) = engine.generate("a red square", params, **inputs)
    default_params = family.params(cfg=False, sampler="ode", num_inference_steps=4, seed=4)
    default = engine.generate("a red square", default_params, **inputs)
    assert not torch.equal(output.trajectory.sigmas, default[0].trajectory.sigmas)
    call = {"num_inference_steps": 4, "height": 32, "width": 32, "sigmas": list(sigmas), **family.no_cfg}
    call |= family.pipeline_inputs(inputs)
    if family.name == "sd3":
        call["guidance_scale"] = 1.0
    elif family.name == "qwen_image":
        call["true_cfg_scale"] = 1.0
    initial = output.trajectory.latents[0][None]
    reference = pipeline(prompt="a red square", latents=initial.clone(), output_type="latent", **call).images
    assert (as_latent_output(family, pipeline, output.trajectory.latents[-1][None]) - reference).abs().max() < 1e-4
    assert torch.allclose(output.trajectory.sigmas, pipeline.scheduler.sigmas.float())
