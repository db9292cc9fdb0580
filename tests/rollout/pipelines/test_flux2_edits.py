"""FLUX.2 [klein] edits from reference images (Flux2KleinPipeline's `image=`): one or several
images per prompt, encoded as the pipeline encodes them, the edit the pipeline's own, re-scored
without a VAE, and a sample's edit the same alone and among other edits and text-only requests.
(The family matrix runs parity, re-scoring and batching with one image in the slow suite.)"""

from __future__ import annotations

import dataclasses

import diffusers
import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from rollout.input_images import InputImages
from rollout.pipelines.families.flux2.adapter import Flux2KleinImages
from rollout.pipelines.loading import load_adapter
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs
from tests.families import FAMILIES, input_image
from tests.rollout.pipelines.test_parity import as_latent_output

pytestmark = pytest.mark.timeout(180)

FLUX2 = FAMILIES["flux2_klein"]
TWO_IMAGES = [input_image(0, 64, 64), input_image(1, 72, 96)]  # 16x16 and 18x24 tokens


@pytest.fixture(scope="module")
def flux2_engine(tiny_models):
    with RolloutEngine(EngineConfig(model=tiny_models("flux2_klein"), max_batch_size=16)) as engine:
        yield engine


@pytest.fixture(scope="module")
def flux2(flux2_engine, tiny_models):
    """(engine, the diffusers pipeline) on the tiny FLUX.2 [klein] folder."""
    pipeline = diffusers.Flux2KleinPipeline.from_pretrained(tiny_models("flux2_klein"))
    pipeline.set_progress_bar_config(disable=True)
    return flux2_engine, pipeline


def replay(pipeline, output, images, **call) -> torch.Tensor:
    """The pipeline's final latents from the output's initial latents, as the engine stores them."""
    latents = pipeline(
        image=InputImages.of(images).pil(),
        prompt=output.prompt,
        latents=output.trajectory.latents[0][None].clone(),
        output_type="latent",
        **call,
    ).images
    return latents, as_latent_output(FLUX2, pipeline, output.trajectory.latents[-1][None])


@pytest.mark.slow
def test_an_edit_with_two_references_is_the_pipelines_bit_for_bit(flux2):
    """Two reference images of different sizes (their tokens at t = 10 and 20), no size asked:
    the output is at the first image's size, and the ODE edit is Flux2KleinPipeline's on the same
    images (bitwise on CPU; the family matrix checks one image, guidance on and off, to 1e-4)."""
    engine, pipeline = flux2
    params = FLUX2.params(cfg=False, sampler="ode", num_inference_steps=2, seed=1, height=None, width=None)
    (output,) = engine.generate("make it red", params, images=[TWO_IMAGES])
    assert output.image.shape == (3, 64, 64)  # the first image's size, as the pipeline makes it
    encoded = output.trajectory.condition.images
    assert isinstance(encoded, Flux2KleinImages) and encoded.latents.dtype == torch.float32
    assert encoded.latents.shape == (16 * 16 + 18 * 24, 16)
    assert encoded.ids[:, 0].unique().tolist() == [10, 20]
    reference, final = replay(pipeline, output, TWO_IMAGES, num_inference_steps=2, guidance_scale=1.0)
    assert torch.equal(final, reference)


def test_the_pipelines_rules_for_reference_images(flux2_engine):
    """An image above a megapixel is scaled to one before rounding (the unsized edit's size
    follows it); images under 64 pixels on a side, longer than 8x their other side, or more than
    four are refused before anything is queued."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    engine = flux2_engine
    spec = engine.model_spec
    big = InputImages.of([torch.zeros(3, 1000, 1300, dtype=torch.uint8)]).pil()[0]
    resized = Flux2ImageProcessor._resize_to_target_area(big, 1024 * 1024)
    multiple = spec.size_multiple  # Flux2KleinPipeline's vae_scale_factor * 2
    assert spec.edit_size(((1000, 1300),)) == (
        resized.height // multiple * multiple,
        resized.width // multiple * multiple,
    )
    assert spec.edit_size(((66, 98),)) == (64, 96)
    for images, message in [
        ([input_image(0, 48, 64)], "smaller than the 64 pixels Flux2KleinPipeline encodes"),
        ([input_image(0, 64, 576)], "longer than 8 times its other side"),
        ([input_image(i, 64, 64) for i in range(5)], "takes at most 4 input images per prompt, got 5"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.generate("x", FLUX2.params(num_inference_steps=2), images=[images])
    assert not engine.has_unfinished_requests()
    # Against --max-pixels a reference counts as the megapixel it is encoded at, not as sent.
    assert spec.encoded_image_pixels(((4096, 4096),) * 4) == (1024 * 1024,) * 4
    try:
        engine.check_requests(["x"], FLUX2.params(num_inference_steps=2), [[(4096, 4096)] * 4])
    except ValueError as error:  # within max_pixels; a tiny block over 4 megapixels' tokens may not fit a CPU's 150 s
        assert "max_pixels" not in str(error) and "step_timeout_s=600" in str(error), error


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_two_reference_parity_with_guidance_on_and_off(flux2, cfg):
    """Guidance as klein's base pipeline defines it (guidance_scale > 1: a second pass against "",
    over the same reference tokens), at a size the request sets, to 1e-4."""
    engine, pipeline = flux2
    params = FLUX2.params(cfg=cfg, sampler="ode", num_inference_steps=4, seed=2)
    (output,) = engine.generate("make it red", params, images=[TWO_IMAGES])
    guidance = FLUX2.cfg if cfg else FLUX2.no_cfg
    reference, final = replay(pipeline, output, TWO_IMAGES, num_inference_steps=4, height=32, width=32, **guidance)
    assert (final - reference).abs().max() < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_reference_edits_rescore_and_batch_independently(flux2, tiny_models):
    """A two-reference edit alone equals itself in a crowd of an edit with one image of another
    size and a text-only request (< 1e-5), and its trajectories re-score to ratio 1 with a trainer
    that has no VAE (the references are carried, never re-encoded)."""
    engine, _ = flux2
    params = FLUX2.params(cfg=True, num_inference_steps=4, seed=21, noise_level=0.7)
    (alone,) = engine.generate("red", params, images=[TWO_IMAGES])
    crowd_params = dataclasses.replace(params, num_samples=2)
    crowd = engine.generate(
        ["red", "blue", "a text-only one"], crowd_params, images=[TWO_IMAGES, [input_image(3, 64, 96)], None]
    )
    a, b = alone.trajectory, crowd[0].trajectory
    assert (a.latents.stack() - b.latents.stack()).abs().max() < 1e-5
    assert (a.log_probs - b.log_probs).abs().max() < 1e-5
    assert crowd[0].trajectory.condition.images is crowd[1].trajectory.condition.images
    trainer_adapter = load_adapter(tiny_models("flux2_klein"))
    trainer_adapter.pipeline.vae = None
    for output in (alone, crowd[2], crowd[4]):
        trajectory = output.trajectory
        log_ratio = (recompute_log_probs(trainer_adapter, trajectory) - trajectory.log_probs)[trajectory.sde_mask]
        assert log_ratio.abs().max() < RATIO_TOLERANCE
