"""Qwen-Image-Edit and Qwen-Image-Edit-Plus beyond the family matrix: the output size of an edit
that sets none is the pipelines' (a megapixel at the input's aspect ratio), a prompt's embeddings
are encoded with its images and shared per (prompt, images), and Plus edits with two reference
images as its pipeline does. The model tests run in the slow suite: each encodes megapixel
reference images."""

from __future__ import annotations

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from rollout.input_images import InputImages
from rollout.model_spec import ModelSpec, area_size
from tests.families import FAMILIES, input_image

pytestmark = pytest.mark.timeout(300)

EDIT_FAMILIES = ("qwen_image_edit", "qwen_image_edit_plus")


def test_the_edit_size_rule_is_the_pipelines_calculate_dimensions():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    for height, width in [(32, 32), (24, 40), (480, 640), (1000, 333), (7, 5000)]:
        expected_width, expected_height, _ = calculate_dimensions(1024 * 1024, width / height)
        assert area_size(1024 * 1024, height, width) == (expected_height, expected_width)
    spec = ModelSpec(
        pipeline_class="QwenImageEditPlusPipeline",
        latent_channels=16,
        vae_scale_factor=8,
        patch_size=1,
        latent_packing=2,
        default_height=1024,
        default_width=1024,
        default_max_sequence_length=512,
        max_sequence_length_limit=1024,
        max_input_images=3,
        edit_area=1024 * 1024,
        edit_size_image=-1,
        prompt_reads_images=True,
    )
    assert spec.edit_size(((32, 32), (480, 640))) == (896, 1184)  # the last image's ratio, as Plus
    assert spec.image_problems(((4, 4), (24, 40))) == []  # any size: the pipeline resizes it
    assert "too narrow" in spec.image_problems(((1, 20000),))[0]
    images = InputImages.of([input_image(0)])
    assert spec.text_key("x", 512, images) == ("x", 512, images.digest)
    assert spec.text_key("x", 512, None) == ("x", 512, None)


@pytest.fixture(scope="module")
def plus_setup(tiny_models):
    family = FAMILIES["qwen_image_edit_plus"]
    path = tiny_models(family.name)
    pipeline = family.diffusers_pipeline(path)  # the real QwenImageEditPlusPipeline; its processor given
    with RolloutEngine(EngineConfig(model=path, max_batch_size=16)) as engine:
        yield family, engine, pipeline


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
@pytest.mark.parametrize("name", [pytest.param("qwen_image_edit_plus", marks=pytest.mark.slow)])
def test_plus_with_two_reference_images_equals_its_pipeline(plus_setup, name, cfg):
    """Two reference images of different sizes: both are encoded (vision tokens and VAE latents)
    and packed after the noisy tokens, as QwenImageEditPlusPipeline does."""
    family, engine, pipeline = plus_setup
    images = [input_image(0, 32, 32), input_image(1, 24, 40)]
    params = family.params(cfg=cfg, sampler="ode", num_inference_steps=4, seed=5)
    (output,) = engine.generate("put the square on the left", params, images=[images])
    assert output.trajectory.condition.images.grids.tolist() == [[1, 32, 32], [1, 25, 41]]
    call = {"num_inference_steps": 4, "height": 32, "width": 32, **(family.cfg if cfg else family.no_cfg)}
    initial = output.trajectory.latents[0][None].clone()
    reference = pipeline(
        prompt="put the square on the left",
        image=InputImages.of(images).pil(),
        latents=initial,
        output_type="latent",
        **call,
    ).images
    assert (output.trajectory.latents[-1][None] - reference).abs().max() < 1e-4


@pytest.mark.parametrize("name", [pytest.param("qwen_image_edit_plus", marks=pytest.mark.slow)])
def test_a_prompts_embeddings_are_shared_per_prompt_and_images(plus_setup, name):
    """The same text with other images is encoded again (its vision tokens differ); with the same
    images, every sample (and every prompt entry) shares one encoding."""
    family, engine, _ = plus_setup
    params = family.params(num_inference_steps=2, num_samples=2, seed=1)
    first, other = [input_image(0)], [input_image(4)]
    outputs = engine.generate(["make it red"] * 3, params, images=[first, other, first])
    conditions = [output.trajectory.condition for output in outputs]
    assert conditions[0].prompt is conditions[1].prompt is conditions[4].prompt
    assert conditions[0].images is conditions[5].images
    assert conditions[2].prompt is not conditions[0].prompt
    assert not torch.equal(conditions[2].prompt.prompt_embeds, conditions[0].prompt.prompt_embeds)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in EDIT_FAMILIES])
def test_an_edit_without_a_size_is_made_at_the_folders_default_area(tiny_models, name):
    """No height or width: the pipeline's rule, at the area the folder names (the tiny folders'
    32 x 32; a published folder's, a megapixel) at the (Plus: last) input image's aspect ratio."""
    family = FAMILIES[name]
    with RolloutEngine(EngineConfig(model=tiny_models(name))) as engine:
        params = family.params(num_inference_steps=2, seed=0, height=None, width=None, output_type="latent")
        spec = engine.model_spec
        sizes = ((24, 72),) if name == "qwen_image_edit" else ((32, 32), (24, 72))
        images = [input_image(i, *size) for i, size in enumerate(sizes)]
        (output,) = engine.generate("x", params, images=[images])
        assert spec.edit_area == 32 * 32
        assert (output.trajectory.height, output.trajectory.width) == spec.edit_size(sizes) == (32, 64)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in EDIT_FAMILIES])
def test_inputs_of_two_sizes_that_encode_alike_share_every_forward(tiny_models, name):
    """Edits batch by the size their input is encoded at, not its own: both pipelines resize an
    input image to a megapixel at its aspect ratio before the VAE, so any two images of one aspect
    ratio encode alike (Edit's vision encoder reads that same resized image). Two such edits run
    in one forward per step, and each equals itself alone (< 1e-5)."""
    from tests.rollout.test_edits import assert_two_edits_share_every_forward, pixels_to_encode

    family = FAMILIES[name]
    sizes = ((32, 32), (40, 40))
    pipeline = family.diffusers_pipeline(tiny_models(name))
    for size in sizes:
        (pil,) = InputImages.of([input_image(5, *size)]).pil()
        run = lambda pil=pil: pipeline(image=pil, prompt="x", height=32, width=32)  # noqa: E731
        assert tuple(pixels_to_encode(pipeline, run).shape[-2:]) == (1024, 1024)
    with RolloutEngine(EngineConfig(model=tiny_models(name), max_batch_size=16)) as engine:
        assert engine.model_spec.encoded_image_sizes(sizes) == ((1024, 1024),) * 2
        images = [input_image(0, *sizes[0]), input_image(1, *sizes[1])]
        params = family.params(num_inference_steps=3, seed=4, noise_level=0.7)
        assert_two_edits_share_every_forward(engine, params, images)
