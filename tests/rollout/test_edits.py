"""Input images as request data, on the first edit family (FLUX.1 Kontext): checked at admission,
encoded once per set of images, shared by the samples that use them, carried in the trajectory,
and the edit is the diffusers pipeline's own. (The family matrix runs the full parity, re-scoring
and batching tests on flux_kontext in the slow suite.)"""

from __future__ import annotations

import dataclasses
import re

import diffusers
import PIL.Image
import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.input_images import InputImages
from rollout.pipelines.families.flux.kontext import KontextImages
from rollout.pipelines.loading import load_adapter
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs
from tests.families import FAMILIES, input_image

pytestmark = pytest.mark.timeout(120)

KONTEXT = FAMILIES["flux_kontext"]


@pytest.fixture(scope="module")
def kontext_engine(tiny_models):
    with RolloutEngine(EngineConfig(model=tiny_models("flux_kontext"), max_batch_size=16)) as engine:
        yield engine


def test_an_edit_is_the_pipelines_edit_bit_for_bit(kontext_engine, tiny_models):
    """The engine's ODE edit from its initial latents is FluxKontextPipeline's on the same image
    (encoded at its own size: auto_resize=False), with the output at the image's size: bitwise on CPU."""
    image = input_image(3, 24, 40)
    params = SamplingParams(sampler="ode", num_inference_steps=3, seed=1, auto_resize=False)
    (output,) = kontext_engine.generate("make it red", params, images=[[image]])
    assert output.image.shape == (3, 24, 40)  # the input's size, as no size was asked for
    pipeline = diffusers.FluxKontextPipeline.from_pretrained(tiny_models("flux_kontext"))
    pipeline.set_progress_bar_config(disable=True)
    (pil,) = InputImages.of([image]).pil()
    reference = pipeline(
        image=pil,
        prompt="make it red",
        latents=output.trajectory.latents[0][None].clone(),
        num_inference_steps=3,
        height=24,
        width=40,
        max_area=24 * 40,
        _auto_resize=False,
        output_type="latent",
    ).images
    assert torch.equal(output.trajectory.latents[-1], reference[0])


def test_samples_share_one_encoding_per_set_of_images(kontext_engine, tiny_models):
    """The samples of a prompt, and every prompt that sends the same image, reference one encoding;
    another image has its own; the trajectory carries it (float32), so re-scoring needs no VAE."""
    same, other = input_image(0), input_image(1)
    params = KONTEXT.params(num_inference_steps=2, num_samples=2, seed=0, noise_level=0.7)
    # The same pixels once as a tensor and once as a PIL image: one digest.
    as_pil = PIL.Image.fromarray(same.permute(1, 2, 0).numpy())
    outputs = kontext_engine.generate(["a", "b", "c"], params, images=[[same], [as_pil], [other]])
    encodings = [o.trajectory.condition.images for o in outputs]
    assert all(isinstance(e, KontextImages) and e.latents.dtype == torch.float32 for e in encodings)
    assert len({id(e) for e in encodings[:4]}) == 1
    assert encodings[4] is encodings[5] and encodings[4] is not encodings[0]
    assert encodings[0].latents.shape == (64, 16) and (encodings[0].ids[:, 0] == 1).all()
    trainer_adapter = load_adapter(tiny_models("flux_kontext"))
    trainer_adapter.pipeline.vae = None  # a trainer without the VAE still re-scores an edit: nothing re-encodes
    for output in outputs[::3]:
        trajectory = output.trajectory
        log_ratio = recompute_log_probs(trainer_adapter, trajectory) - trajectory.log_probs
        assert log_ratio.abs().max() < RATIO_TOLERANCE
    # The image changes the edit: same prompt and seed, another image, other latents.
    assert not torch.equal(outputs[0].trajectory.latents[-1], outputs[4].trajectory.latents[-1])


@pytest.mark.parametrize(
    ("images", "error", "message"),
    [
        ([[input_image(0), input_image(1)]], ValueError, "takes at most 1 input images per prompt, got 2"),
        ([[input_image(0).float()]], ValueError, r"images\[0\]\[0\] must be uint8 \[3, H, W\]"),
        ([[torch.zeros(3, 2, 2, dtype=torch.uint8)]], ValueError, "smaller than the 4 pixels"),
        ([[input_image(0)], [input_image(1)]], ValueError, "images for 2 prompts but 1 prompts"),
        (input_image(0), TypeError, "one entry per prompt"),
        ([[]], ValueError, r"images\[0\] is an empty list"),
    ],
    ids=["too-many", "float", "too-small", "count", "bare-tensor", "empty"],
)
def test_bad_images_are_refused_before_anything_is_queued(kontext_engine, images, error, message):
    with pytest.raises(error, match=message):
        kontext_engine.generate("x", KONTEXT.params(num_inference_steps=2), images=images)
    assert not kontext_engine.has_unfinished_requests()


def test_a_text_to_image_family_refuses_images_and_names_the_edit_families(engine):
    with pytest.raises(ValueError, match=r"StableDiffusion3Pipeline takes no input images.*flux_kontext"):
        engine.generate("x", SamplingParams(height=32, width=32), images=[[input_image(0)]])


def test_input_images_past_the_engine_s_budget_are_refused_by_their_sizes(kontext_engine, engine):
    """An input image counts against max_pixels as the model encodes it, beside the output (with
    auto_resize off Kontext encodes it at its own size: 4096 x 4096 beside a 32 x 32 output ran a
    tiny model's first step for hours); pixels per image as sent and images per request have
    limits of their own. The sizes alone decide, so a server asks before it decodes anything."""
    raw = KONTEXT.params(num_inference_steps=2, height=32, width=32, auto_resize=False)
    with pytest.raises(ValueError, match=re.escape("the output's 1024 pixels plus the 16777216 its input images")):
        kontext_engine.check_requests(["x"], raw, [[(4096, 4096)]])
    resized = dataclasses.replace(raw, auto_resize=True)  # to about a megapixel first, as the pipeline's default
    try:
        kontext_engine.check_requests(["x"], resized, [[(4096, 4096)]])
    except ValueError as error:  # within max_pixels; the tiny VAE's attention over a megapixel may not fit
        assert "max_pixels" not in str(error) and "step_timeout_s=600" in str(error), error  # a CPU's 150 s
    with pytest.raises(ValueError, match=re.escape("(12000x12000 = 144000000 pixels) is above this engine's limit")):
        kontext_engine.check_requests(["x"], KONTEXT.params(), [[(12000, 12000)]])
    images = [[input_image(k)] for k in range(17)]
    with pytest.raises(ValueError, match=re.escape("17 input images is above this engine's limit of 16")):
        kontext_engine.generate(["x"] * 17, KONTEXT.params(num_inference_steps=2), images=images)
    assert not kontext_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="StableDiffusion3Pipeline takes no input images.*max_input_pixels"):
        engine.check_requests(["x"], SamplingParams(), [[(12000, 12000)]])


def test_an_edit_family_that_needs_images_says_so(kontext_engine):
    """FLUX.1 Kontext runs text-only requests as FLUX.1 does; a family whose pipeline needs an
    image (Qwen-Image-Edit's) sets min_input_images, and a request without one is told what to pass."""
    needs_one = dataclasses.replace(kontext_engine.model_spec, min_input_images=1)
    (problem,) = needs_one.image_problems(())
    assert "FluxKontextPipeline edits input images: pass images=[[image], ...] with 1 or more" in problem
    assert kontext_engine.model_spec.image_problems(()) == []


class _Stop(Exception):
    """Raised by a forward pre-hook to stop at the VAE's encoder, once the pixels it gets are known."""


def pixels_to_encode(pipeline, run) -> torch.Tensor:
    """The pixels [1, 3, H, W] `run()` feeds `pipeline`'s VAE encoder first (it is stopped there)."""
    captured = []

    def capture(module, args):
        captured.append(args[0])
        raise _Stop

    hook = pipeline.vae.encoder.register_forward_pre_hook(capture)
    try:
        with pytest.raises(_Stop):
            run()
    finally:
        hook.remove()
    return captured[0]


def assert_two_edits_share_every_forward(engine, params, images) -> None:
    """Two edit requests (one input image each, `params` of 3 steps) run in one forward at each
    step, and each equals itself run alone (latents and log-probs < 1e-5)."""
    alone = []
    for prompt_index, image in enumerate(images):  # its seeds as among the prompts of `together`
        engine.add_request("make it red", params, images=[image], prompt_index=prompt_index)
        while engine.has_unfinished_requests():
            alone += engine.step()
    reports = []
    stop_watching = engine.add_step_observer(reports.append)
    try:
        together = engine.generate(["make it red"] * 2, params, images=[[image] for image in images])
    finally:
        stop_watching()
    # Both rows in one forward at each of the 3 steps (batched apart: 6 steps of one row each).
    assert [report.transformer_rows for report in reports if report.kind == "step"] == [(2,)] * 3
    for one, crowd in zip(alone, together, strict=True):
        assert (one.trajectory.latents.stack() - crowd.trajectory.latents.stack()).abs().max() < 1e-5
        assert (one.trajectory.log_probs - crowd.trajectory.log_probs).abs().max() < 1e-5
    assert not torch.equal(together[0].trajectory.latents[-1], together[1].trajectory.latents[-1])


def test_kontext_resizes_its_input_as_its_pipeline_does(kontext_engine, tiny_models):
    """auto_resize=True is FluxKontextPipeline's default `_auto_resize=True` (a published folder's
    default too; the tiny folder's is off: tests/rollout/pipelines/test_sampling_defaults.py): the
    input is resized to the nearest preferred Kontext resolution, bitwise the pixels the pipeline
    encodes (compared at the VAE's input: the tiny VAE's mid-block attention over a megapixel's
    latents, and a transformer over ~66k image tokens, are past a test's means; from there on both
    run the path the own-size parity tests check), and an edit that sets no size is made at that
    resolution. auto_resize=False is another encoding (digest), cached and batched apart."""
    spec = kontext_engine.model_spec
    resolved, problems = spec.resolve(SamplingParams(height=32, width=32))
    assert problems == [] and resolved.auto_resize is False  # the tiny folder's default
    assert spec.resolve(SamplingParams(height=32, width=32, auto_resize=True))[0].auto_resize is True
    assert spec.edit_size(((24, 40),), auto_resize=True) == (800, 1328)  # (1328, 800): the nearest aspect ratio
    images = InputImages.of([input_image(5, 24, 40)])
    adapter = load_adapter(tiny_models("flux_kontext"))
    pipeline = adapter.pipeline  # the FluxKontextPipeline itself, called as a user would
    expected = pixels_to_encode(
        pipeline, lambda: pipeline(image=images.pil()[0], prompt="x", height=32, width=32, max_area=32 * 32)
    )
    assert tuple(expected.shape) == (1, 3, 800, 1328)
    resized = images.encoded_with(auto_resize=True)
    assert torch.equal(pixels_to_encode(adapter.pipeline, lambda: adapter.encode_images(resized)), expected)
    own_size = images.encoded_with(auto_resize=False)
    assert own_size.digest != resized.digest != images.digest
    for unresized in (own_size, images):  # images with no setting: the folder's default
        assert adapter.encode_images(unresized).latents.shape == (60, 16)  # 24x40 as it is: 6 x 10 tokens


def test_auto_resize_is_refused_by_a_family_without_it(engine):
    with pytest.raises(ValueError, match="auto_resize is FLUX.1 Kontext's resize of its input image"):
        engine.generate("x", SamplingParams(height=32, width=32, auto_resize=False))


def test_inputs_of_two_sizes_that_encode_alike_share_every_forward(kontext_engine, tiny_models):
    """Edits batch by the size their input is encoded at, not its own: auto-resized (FLUX.1
    Kontext's default), any two images of one aspect ratio encode at one preferred resolution, as
    the pipeline encodes them; at their own size, sizes that round down alike. Two such edits run
    in one forward per step, and each equals itself alone (< 1e-5)."""
    spec = kontext_engine.model_spec
    assert spec.encoded_image_sizes(((24, 40), (30, 50), (26, 43)), auto_resize=True) == ((800, 1328),) * 3
    pipeline = load_adapter(tiny_models("flux_kontext")).pipeline
    for height, width in ((30, 50), (26, 43)):
        (pil,) = InputImages.of([input_image(5, height, width)]).pil()
        run = lambda pil=pil: pipeline(image=pil, prompt="x", height=32, width=32, max_area=32 * 32)  # noqa: E731
        assert tuple(pixels_to_encode(pipeline, run).shape) == (1, 3, 800, 1328)
    # Encoded at their own size (the tiny requests', auto_resize=False): 34x35 rounds down to 32x32.
    assert spec.encoded_image_sizes(((32, 32), (34, 35))) == ((32, 32), (32, 32))
    images = [input_image(0, 32, 32), input_image(1, 34, 35)]
    params = KONTEXT.params(num_inference_steps=3, seed=4, noise_level=0.7)
    assert_two_edits_share_every_forward(kontext_engine, params, images)
