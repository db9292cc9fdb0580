"""Wan image-to-video (`WanImageToVideoPipeline`: Wan 2.1 I2V with CLIP image embeddings, Wan 2.2
I2V with two experts) through the family contract: the first frame is the request's input image;
the ODE path and the frames are the pipeline's given the same initial latents and image, re-scoring
gives ratio 1, a sample does not depend on its batch, CFG is the pipeline's `guidance_scale`, the
first frame is encoded once per (image, size, frames) and held once by a group, and requests the
model cannot take are refused at admission with the rule named."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from rollout.input_images import InputImages
from tests.families import IMAGE_TO_VIDEO_FAMILIES as I2V_FAMILIES
from tests.families import input_image
from tests.rollout.pipelines.family_checks import assert_ratio_one, family_engines, over_the_wire
from tests.rollout.pipelines.first_frames import assert_one_first_frame_is_required, counted_encodings

pytestmark = pytest.mark.timeout(180)

IMAGE_TO_VIDEO_FAMILIES = {
    name: f for name, f in I2V_FAMILIES.items() if f.pipeline_class == "WanImageToVideoPipeline"
}
FRAME = input_image(0, 24, 40)  # another size than the 32x32 video: the pipeline resizes it


i2v = family_engines(IMAGE_TO_VIDEO_FAMILIES)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_ode_rollout_and_frames_equal_the_pipeline_given_the_first_frame(i2v, cfg):
    # WanImageToVideoPipeline's text cleaning calls ftfy whether or not it is installed (the engine
    # encodes text as WanPipeline does, which runs ftfy only where installed: the same embeddings).
    pytest.importorskip("ftfy", reason="WanImageToVideoPipeline.__call__ needs ftfy")
    family, engine, pipeline, _ = i2v
    params = family.params(cfg=cfg, sampler="ode", num_inference_steps=6, seed=3)
    (output,) = engine.generate("a red square", params, images=[[FRAME]])
    t = output.trajectory
    assert t.latents[0].shape == (4, 5, 16, 16)  # the noisy latents alone: [C, F', h, w]
    assert (t.condition.negative is not None) == cfg  # guidance_scale > 1: a second pass, as the pipeline's
    if family.name == "wan22_i2v":  # the schedule crosses the boundary (900): both experts ran
        assert t.timesteps.max() >= 900 > t.timesteps.min()
    guidance = family.cfg if cfg else family.no_cfg
    call = {"num_inference_steps": 6, "height": 32, "width": 32, "num_frames": 9, **guidance}
    (image,) = InputImages.of([FRAME]).pil()
    initial = t.latents[0][None]
    reference = pipeline(image, "a red square", latents=initial.clone(), output_type="latent", **call).frames
    assert (t.latents[-1] - reference[0]).abs().max() < 1e-4
    frames = pipeline(image, "a red square", latents=initial.clone(), output_type="np", **call).frames
    reference_uint8 = torch.from_numpy((frames[0] * 255).round().astype("uint8")).permute(0, 3, 1, 2)
    assert output.video.shape == (9, 3, 32, 32)
    assert (output.video.int() - reference_uint8.int()).abs().max() <= 1


@pytest.mark.parametrize("sampler", ["flow_sde", "cps"])
def test_rescoring_gives_ratio_one(i2v, sampler):
    family, engine, _, trainer_adapter = i2v
    params = family.params(cfg=True, sampler=sampler, noise_level=0.5, num_inference_steps=4, num_samples=2, seed=1)
    images = family.inputs(2)["images"]
    assert_ratio_one(trainer_adapter, engine.generate(["a red square", "a blue circle"], params, images=images))


def test_samples_do_not_depend_on_their_batch_mates(i2v):
    family, engine, _, _ = i2v
    short = family.params(num_inference_steps=3, seed=4)
    long = family.params(num_inference_steps=3, seed=4, num_frames=13)
    (alone,) = engine.generate("a red square", short, images=[[FRAME]])
    # Prompt index 0 again (seeds follow it), with other prompts, first frames and frame counts in flight.
    frames = [[FRAME], [input_image(1)], [input_image(2, 40, 24)], [FRAME]]
    crowd = engine.generate(["a red square", "other", "more", "else"], [short, short, short, long], images=frames)
    assert (alone.trajectory.latents.stack() - crowd[0].trajectory.latents.stack()).abs().max() < 1e-5
    assert crowd[0].video.shape == (9, 3, 32, 32) and crowd[3].video.shape == (13, 3, 32, 32)


def test_the_first_frame_is_encoded_once_and_held_once_by_a_group(i2v):
    family, engine, _, _ = i2v
    with counted_encodings(engine) as calls:
        params = family.params(num_inference_steps=2, num_samples=3, seed=5)
        group = engine.generate(["a", "b"], params, images=[[FRAME], [FRAME]])
        longer = engine.generate("a", family.params(num_inference_steps=2, seed=5, num_frames=13), images=[[FRAME]])
    assert calls == [9, 13]  # one encoding per (image, size, frames): the frames after it change it
    first = group[0].trajectory.condition.images
    assert all(output.trajectory.condition.images is first for output in group)
    assert first.condition.shape == (2 + 4, 5, 16, 16)  # mask (the tiny VAE's temporal scale 2) + latents
    assert longer[0].trajectory.condition.images.condition.shape[1] == 7
    clip_tokens = (0,) if family.name == "wan22_i2v" else (17, 32)  # Wan 2.2 reads no image embeddings
    assert tuple(first.image_embeds.shape) == clip_tokens


def test_requests_the_model_cannot_take_are_refused_at_admission(i2v):
    family, engine, _, _ = i2v
    assert_one_first_frame_is_required(engine, family.params(), FRAME)
    with pytest.raises(ValueError, match=r"num_frames=8 does not fit WanImageToVideoPipeline's VAE, .* num_frames=9"):
        engine.generate("x", family.params(num_frames=8), images=[[FRAME]])
    with pytest.raises(ValueError, match=r"height=34 is not divisible by 4"):
        engine.generate("x", family.params(height=34), images=[[FRAME]])
    # The pipeline's default 480x832 is past the tiny transformer's rotary table (the tiny folder's
    # default is its own 32x32: a request without a size is made at that, not at the image's size).
    with pytest.raises(ValueError, match=r"height=480 is above the 256 pixels .*rope_max_seq_len 64 tokens"):
        engine.generate("x", SamplingParams(height=480, width=832, num_frames=9), images=[[FRAME]])
    with pytest.raises(ValueError, match=r"num_frames=129 is above the 127 frames"):
        engine.generate("x", family.params(num_frames=129), images=[[FRAME]])
    assert not engine.has_unfinished_requests()


def test_wan22_guidance_scale_2_acts_on_the_low_noise_steps_only(i2v):
    family, engine, _, _ = i2v
    if family.name != "wan22_i2v":
        pytest.skip("Wan 2.2 only")
    base = family.params(cfg=True, sampler="ode", num_inference_steps=6, seed=3)
    (plain,) = engine.generate("x", base, images=[[FRAME]])
    (changed,) = engine.generate("x", SamplingParams(**{**base.__dict__, "guidance_scale_2": 7.0}), images=[[FRAME]])
    a, b = plain.trajectory.latents.stack(), changed.trajectory.latents.stack()
    high_steps = int((plain.trajectory.timesteps >= 900).sum())
    assert torch.equal(a[: high_steps + 1], b[: high_steps + 1]) and not torch.equal(a[-1], b[-1])


def test_the_first_frame_crosses_the_wire_once_per_answer(i2v):
    family, engine, _, _ = i2v
    outputs = engine.generate(
        "a red square", family.params(num_inference_steps=2, num_samples=2, seed=9), images=[[FRAME]]
    )
    first, second = over_the_wire(outputs)  # one answer's stream
    sent = outputs[0].trajectory.condition.images
    assert first.trajectory.condition.images is second.trajectory.condition.images  # decoded once, shared
    for name, tensor in sent.tensors().items():
        assert torch.equal(getattr(first.trajectory.condition.images, name), tensor)
    assert torch.equal(first.video, outputs[0].video)
