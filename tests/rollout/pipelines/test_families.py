"""What every model family keeps: batch independence with prompts of different token lengths,
refusal of request fields the model does not use, and padded, masked conditioning batches."""

from __future__ import annotations

import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.families.qwen_image.adapter import QwenImageEmbeds
from rollout.pipelines.families.sd3.adapter import SD3Embeds
from tests.families import FAMILIES, input_image, matrix

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=matrix())
def family_engine(request, tiny_models):
    family = FAMILIES[request.param]
    with RolloutEngine(EngineConfig(model=tiny_models(family.name), max_batch_size=16)) as engine:
        yield family, engine


def test_a_sample_alone_equals_the_sample_in_a_mixed_batch(family_engine):
    """Prompts of different lengths (Qwen-Image pads and masks them), with and without guidance,
    different samplers: the first sample's trajectory is the same alone and in the crowd. An edit
    family's crowd holds another edit with an image of another size, and a text-only request."""
    family, engine = family_engine
    alone_params = family.params(cfg=True, num_inference_steps=4, seed=21)
    (alone,) = engine.generate("red", alone_params, **family.inputs(1))
    prompts = ["red", "a long prompt about a green circle in a wide field at noon", "blue"]
    crowd_params = [
        family.params(cfg=True, num_inference_steps=4, seed=21, num_samples=3),
        family.params(cfg=False, num_inference_steps=4, seed=21, num_samples=3, sampler="cps"),
        family.params(cfg=True, num_inference_steps=6, seed=21, num_samples=3, sampler="dance_sde", noise_level=0.3),
    ]
    square, other = family.edit_sizes
    # The third is text-only where the family allows it (Qwen-Image-Edit's pipelines need an image).
    third = [input_image(2, *reversed(other))] if engine.model_spec.min_input_images else None
    crowd_inputs = {"images": [[input_image(0, *square)], [input_image(1, *other)], third]} if family.edits else {}
    crowd = engine.generate(prompts, crowd_params, **crowd_inputs)
    a, b = alone.trajectory, crowd[0].trajectory
    assert (a.latents.stack() - b.latents.stack()).abs().max() < 1e-5
    assert (a.log_probs - b.log_probs).abs().max() < 1e-5
    assert not torch.equal(crowd[0].trajectory.latents.stack(), crowd[3].trajectory.latents.stack())


def test_trajectory_form_is_the_pipelines_latents_argument(family_engine):
    family, engine = family_engine
    (output,) = engine.generate("x", family.params(num_inference_steps=3, seed=0), **family.inputs(1))
    expected = {
        "sd3": (4, 4, 16, 16),
        "flux": (4, 64, 16),
        "qwen_image": (4, 64, 16),
        "flux2_klein": (4, 16, 8, 8),
        "zimage": (4, 4, 16, 16),
        "flux_kontext": (4, 64, 16),
        # The tiny edit VAE compresses by 16 (a megapixel reference image is 1024 tokens): one token.
        "qwen_image_edit": (4, 1, 16),
        "qwen_image_edit_plus": (4, 1, 16),
        # Qwen-Image 2.1 reads its 16x latents unpatched: 2x2 tokens of 4 channels.
        "qwen_image21": (4, 4, 4),
        "flux2_dev": (4, 16, 8, 8),  # as FLUX.2 [klein]
    }
    # Packed 2x2 patches for FLUX.1 and Qwen-Image; FLUX.2 patchifies 2x2 into channels on the grid.
    assert tuple(output.trajectory.latents.stack().shape) == expected[family.name]
    assert (output.trajectory.height, output.trajectory.width) == (32, 32)
    assert output.image.shape == (3, 32, 32)


# Per family: a request field it does not use (or a combination it cannot honour), and the error.
REFUSED = {
    "sd3": [
        ({"true_cfg_scale": 2.0}, "true_cfg_scale is not used by StableDiffusion3Pipeline"),
        ({"guidance_scale": 1.0, "negative_prompt": "ugly"}, "negative_prompt is used only with classifier-free"),
        ({"num_frames": 9}, "num_frames is for video pipelines"),
        ({"max_sequence_length": 600}, "max_sequence_length=600 is above StableDiffusion3Pipeline's limit of 512"),
    ],
    "flux": [
        ({"true_cfg_scale": 3.0}, "true_cfg_scale=3.0 turns on classifier-free guidance, which needs a negative"),
        ({"negative_prompt": "ugly"}, "negative_prompt is used only with classifier-free guidance"),
        ({"height": 30}, r"height=30 is not divisible by 4 \(VAE scale 2 x patch size 1 x latent packing 2\)"),
    ],
    "flux_kontext": [
        ({"true_cfg_scale": 3.0}, "true_cfg_scale=3.0 turns on classifier-free guidance, which needs a negative"),
        ({"height": 30}, r"height=30 is not divisible by 4 \(VAE scale 2 x patch size 1 x latent packing 2\)"),
    ],
    "qwen_image": [
        ({"guidance_scale": 4.0}, "guidance_scale is not used by QwenImagePipeline; leave it unset"),
        ({"true_cfg_scale": 4.0}, "needs a negative_prompt"),
        ({"num_frames": 9}, "num_frames is for video pipelines"),
        ({"num_inference_steps": 1}, "num_inference_steps=1 is too few for QwenImagePipeline"),
    ],
    "qwen_image21": [
        ({"guidance_scale": 4.0}, "guidance_scale is not used by QwenImage21Pipeline; leave it unset"),
        ({"true_cfg_scale": 4.0}, "needs a negative_prompt"),
        ({"num_frames": 9}, "num_frames is for video pipelines"),
        # one slot of the text sequence per 2x2 group of 16x latents: multiples of 32 pixels
        ({"max_sequence_length": 64}, "max_sequence_length is not used by QwenImage21Pipeline"),
        ({"height": 48}, r"height=48 is not divisible by 32 \(VAE scale 8 x patch size 2 x latent packing 2\)"),
    ],
    "qwen_image_edit": [
        ({}, "QwenImageEditPipeline edits input images: pass images="),
        ({"guidance_scale": 4.0}, "guidance_scale is not used by QwenImageEditPipeline; leave it unset"),
        ({"true_cfg_scale": 4.0}, "needs a negative_prompt"),
    ],
    "qwen_image_edit_plus": [
        ({}, "QwenImageEditPlusPipeline edits input images: pass images="),
        ({"guidance_scale": 4.0}, "guidance_scale is not used by QwenImageEditPlusPipeline; leave it unset"),
    ],
    "flux2_klein": [
        ({"true_cfg_scale": 4.0}, "true_cfg_scale is not used by Flux2KleinPipeline; leave it unset"),
        ({"guidance_scale": 1.0, "negative_prompt": "ugly"}, "negative_prompt is used only with classifier-free"),
        ({"height": 30}, r"height=30 is not divisible by 4 \(VAE scale 4 x patch size 1\)"),
        ({"max_sequence_length": 600}, "max_sequence_length=600 is above Flux2KleinPipeline's limit of 512"),
    ],
    "flux2_dev": [
        ({"true_cfg_scale": 4.0}, "true_cfg_scale is not used by Flux2Pipeline; leave it unset"),
        # guidance-distilled: no classifier-free guidance pass, so no negative prompt
        ({"negative_prompt": "ugly"}, "negative_prompt"),
        ({"height": 30}, r"height=30 is not divisible by 4 \(VAE scale 4 x patch size 1\)"),
        ({"max_sequence_length": 600}, "max_sequence_length=600 is above Flux2Pipeline's limit of 512"),
    ],
    "zimage": [
        ({"true_cfg_scale": 2.0}, "true_cfg_scale is not used by ZImagePipeline; leave it unset"),
        # Z-Image guides from a scale above 0, not 1.
        ({"guidance_scale": 0.0, "negative_prompt": "ugly"}, "which ZImagePipeline turns on with guidance_scale > 0"),
        ({"height": 30}, r"height=30 is not divisible by 4 \(VAE scale 2 x patch size 2\)"),
        ({"max_sequence_length": 1600}, "max_sequence_length=1600 is above ZImagePipeline's limit of 1504"),
    ],
}


def test_fields_the_model_does_not_use_are_refused(family_engine):
    family, engine = family_engine
    for fields, message in REFUSED[family.name]:
        with pytest.raises(ValueError, match=message):
            engine.generate("x", SamplingParams(**{"height": 32, "width": 32, **fields}))
    assert not engine.has_unfinished_requests()


def test_defaults_come_from_the_model(family_engine):
    family, engine = family_engine
    resolved, problems = engine.model_spec.resolve(SamplingParams(height=32, width=32))
    assert problems == []
    expected = {
        "sd3": (4.5, None, "", 256),  # CFG with the empty negative prompt, as diffusers
        "flux": (3.5, 1.0, None, 512),  # FLUX.1-dev's distilled guidance; true CFG off
        "flux_kontext": (3.5, 1.0, None, 512),  # as FLUX.1-dev
        "qwen_image": (None, 1.0, None, 512),
        "qwen_image_edit": (None, 1.0, None, 512),
        "qwen_image21": (None, 1.0, None, 4096),  # the pipeline reads whole prompts
        "qwen_image_edit_plus": (None, 1.0, None, 512),
        "flux2_klein": (4.0, None, "", 512),  # a base klein model: CFG against "", as the pipeline
        "flux2_dev": (4.0, None, None, 512),  # its distilled guidance input; no CFG pass
        "zimage": (5.0, None, "", 512),  # ZImagePipeline's defaults: CFG with the negative prompt ""
    }[family.name]
    got = (resolved.guidance_scale, resolved.true_cfg_scale, resolved.negative_prompt, resolved.max_sequence_length)
    assert got == expected


def test_stacking_pads_and_masks_prompts_of_different_lengths():
    short = QwenImageEmbeds(torch.ones(3, 4), torch.ones(3, dtype=torch.bool))
    long = QwenImageEmbeds(torch.full((5, 4), 2.0), torch.ones(5, dtype=torch.bool))
    batch = QwenImageEmbeds.stack([short, long])
    assert batch.prompt_embeds.shape == (2, 5, 4) and batch.prompt_mask.tolist()[0] == [True] * 3 + [False] * 2
    assert torch.equal(batch.prompt_embeds[0, 3:], torch.zeros(2, 4))
    # Each row's own length stays on the host, through a move as well: a family reads it, not the mask.
    assert batch.lengths == (3, 5) and batch.to("cpu", torch.float64).lengths == (3, 5)
    assert short.lengths is None
    with pytest.raises(ValueError, match="SD3Embeds.prompt_embeds differs in shape between prompts"):
        SD3Embeds.stack([SD3Embeds(torch.ones(3, 4), torch.ones(2)), SD3Embeds(torch.ones(5, 4), torch.ones(2))])
