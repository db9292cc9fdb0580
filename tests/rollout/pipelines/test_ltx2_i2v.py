"""LTX-2 image-to-video (`LTX2ImageToVideoPipeline`: a video and its sound from a first frame) through
the family contract. The first frame is conditioning, not state: a sample's latents are the packed
video tokens of latent frames 1.. then the audio. The ODE path gives the pipeline's final latents,
frames and waveform when the pipeline encodes the same image itself and starts from the same
noise; re-scoring gives ratio 1; a sample does not depend on its batch; the frame is encoded once
per (image, size, frames) and held once by a group; requests the model cannot take are refused at
admission with the rule named."""

from __future__ import annotations

import pytest
import torch

from rollout.input_images import InputImages
from tests.families import AUDIO_VIDEO_FAMILIES, input_image
from tests.rollout.pipelines.family_checks import (
    assert_ratio_one,
    assert_same_sample,
    engine_and_pipeline,
    over_the_wire,
)
from tests.rollout.pipelines.first_frames import assert_one_first_frame_is_required, counted_encodings

pytestmark = pytest.mark.timeout(180)

FAMILY = AUDIO_VIDEO_FAMILIES["ltx2_i2v"]
# The tiny VAE halves space and time: 9 frames of 32x32 are 5 latent frames of 16 x 16 tokens of 4
# channels, the first of them the given frame; the audio is text-to-video's, 9 frames of 4 features.
FRAME_TOKENS, VIDEO_FEATURES, AUDIO_FRAMES, AUDIO_FEATURES = 16 * 16, 4, 9, 4
MADE_SIZE = 4 * FRAME_TOKENS * VIDEO_FEATURES  # latent frames 1..4
LENGTH = {"max_sequence_length": 64}
FRAME = input_image(0, 24, 40)  # another size than the 32x32 video: the pipeline resizes it


@pytest.fixture(scope="module")
def ltx2_i2v(tiny_models):
    """(engine, the diffusers pipeline, a trainer's adapter) on the same tiny folder."""
    with engine_and_pipeline(FAMILY, tiny_models(FAMILY.name), max_batch_size=16) as setup:
        yield setup


def run_pipeline(pipeline, initial: torch.Tensor, params, **call) -> tuple:
    """LTX2ImageToVideoPipeline from the trajectory's x_0 [N]: the pipeline encodes FRAME itself
    (its own `prepare_latents`, which draws noise for every latent frame); the noise of frames 1..
    is replaced by x_0's video part, and x_0's audio (normalised) is its `audio_latents=`
    (denormalised, as the pipeline normalises what it is given). Returns the pipeline's output
    and the first frame's tokens it encoded [S_0, C]."""
    made = initial[:MADE_SIZE].reshape(1, -1, VIDEO_FEATURES)
    audio = initial[MADE_SIZE:].reshape(1, AUDIO_FRAMES, AUDIO_FEATURES)
    stats = pipeline.audio_vae
    prepare, encoded = pipeline.prepare_latents, {}

    def with_initial_noise(*args, **kwargs):
        latents, mask = prepare(*args, **kwargs)
        encoded["first"] = latents[0, :FRAME_TOKENS].clone()
        return torch.cat([latents[:, :FRAME_TOKENS], made], dim=1), mask

    pipeline.prepare_latents = with_initial_noise  # an instance attribute: shadows the class's method
    try:
        output = pipeline(
            image=InputImages.of([FRAME]).pil()[0],
            prompt="a red square",
            height=32,
            width=32,
            num_frames=9,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            audio_latents=audio * stats.latents_std + stats.latents_mean,
            **LENGTH,
            **FAMILY.pipeline_extra,
            **call,
        )
    finally:
        del pipeline.prepare_latents
    return output, encoded["first"]


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_ode_rollout_video_and_audio_equal_the_pipeline_given_the_first_frame(ltx2_i2v, cfg):
    engine, pipeline, _ = ltx2_i2v
    params = FAMILY.params(cfg=cfg, sampler="ode", num_inference_steps=6, seed=3, **LENGTH)
    (output,) = engine.generate("a red square", params, images=[[FRAME]])
    t = output.trajectory
    assert t.latents[0].shape == (MADE_SIZE + AUDIO_FRAMES * AUDIO_FEATURES,)  # no first frame in the state
    assert (t.condition.negative is not None) == cfg
    reference, first = run_pipeline(pipeline, t.latents[0], params, output_type="latent")
    assert torch.equal(t.condition.images.tokens, first)  # the pipeline's own encoding (image_crf=0)
    final = t.latents[-1]
    video = torch.cat([first, final[:MADE_SIZE].reshape(-1, VIDEO_FEATURES)])[None]
    video = pipeline._unpack_latents(video, 5, 16, 16, 1, 1)
    vae = pipeline.vae
    video = pipeline._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    audio = final[MADE_SIZE:].reshape(1, AUDIO_FRAMES, AUDIO_FEATURES)
    audio = audio * pipeline.audio_vae.latents_std + pipeline.audio_vae.latents_mean
    audio = pipeline._unpack_audio_latents(audio, AUDIO_FRAMES, num_mel_bins=2)
    assert (video - reference.frames).abs().max() < 1e-4
    assert (audio - reference.audio).abs().max() < 1e-4

    decoded, _ = run_pipeline(pipeline, t.latents[0], params, output_type="np")
    frames = torch.from_numpy((decoded.frames[0] * 255).round().astype("uint8")).permute(0, 3, 1, 2)
    assert output.video.shape == (9, 3, 32, 32) and output.image is None
    assert (output.video.int() - frames.int()).abs().max() <= 1
    assert output.audio.shape == decoded.audio[0].shape
    assert (output.audio - decoded.audio[0].float()).abs().max() < 1e-4


@pytest.mark.parametrize("sampler", ["flow_sde", "cps"])
def test_rescoring_gives_ratio_one(ltx2_i2v, sampler):
    engine, _, trainer_adapter = ltx2_i2v
    params = FAMILY.params(cfg=True, sampler=sampler, noise_level=0.5, num_inference_steps=4, num_samples=2, seed=1)
    images = FAMILY.inputs(2)["images"]
    assert_ratio_one(trainer_adapter, engine.generate(["a red square", "a blue circle"], params, images=images))


def test_a_sample_alone_equals_the_sample_in_a_mixed_batch(ltx2_i2v):
    """Other prompts, first frames, frame counts (so other audio lengths), guidance and samplers in flight."""
    engine, _, _ = ltx2_i2v
    alone_params = FAMILY.params(cfg=True, sampler="flow_sde", noise_level=0.7, num_inference_steps=4, seed=21)
    (alone,) = engine.generate("red", alone_params, images=[[FRAME]])
    crowd_params = [
        FAMILY.params(cfg=True, sampler="flow_sde", noise_level=0.7, num_inference_steps=4, seed=21, num_samples=2),
        FAMILY.params(cfg=False, num_inference_steps=4, seed=21, num_samples=2, sampler="cps", num_frames=13),
        FAMILY.params(cfg=True, num_inference_steps=6, seed=21, num_samples=2, sampler="dance_sde", noise_level=0.3),
    ]
    frames = [[FRAME], [input_image(1)], [input_image(2, 40, 24)]]
    crowd = engine.generate(["red", "a green circle in a wide field at noon", "blue"], crowd_params, images=frames)
    assert_same_sample(alone, crowd[0])
    assert crowd[2].video.shape == (13, 3, 32, 32) and crowd[2].audio.shape[-1] > crowd[0].audio.shape[-1]


def test_the_first_frame_is_encoded_once_and_held_once_by_a_group(ltx2_i2v):
    engine, _, _ = ltx2_i2v
    with counted_encodings(engine) as calls:
        group = engine.generate(
            ["a", "b"], FAMILY.params(num_inference_steps=2, num_samples=3, seed=5), images=[[FRAME], [FRAME]]
        )
        longer = engine.generate("a", FAMILY.params(num_inference_steps=2, seed=5, num_frames=13), images=[[FRAME]])
    assert calls == [9, 13]  # one encoding per (image, size, frames)
    first = group[0].trajectory.condition.images
    assert all(output.trajectory.condition.images is first for output in group)
    assert first.tokens.shape == (FRAME_TOKENS, VIDEO_FEATURES)  # one latent frame, whatever the frame count
    assert torch.equal(longer[0].trajectory.condition.images.tokens, first.tokens)


def test_requests_the_model_cannot_take_are_refused_at_admission(ltx2_i2v):
    engine, _, _ = ltx2_i2v
    assert_one_first_frame_is_required(engine, FAMILY.params(), FRAME)
    with pytest.raises(ValueError, match=r"num_frames=8 does not fit LTX2ImageToVideoPipeline's VAE, .* num_frames=9"):
        engine.generate("x", FAMILY.params(num_frames=8), images=[[FRAME]])
    with pytest.raises(ValueError, match=r"height=48 is not divisible by 32 \(.*own rule: multiples of 32\)"):
        engine.generate("x", FAMILY.params(height=48), images=[[FRAME]])
    with pytest.raises(ValueError, match="true_cfg_scale is not used by LTX2ImageToVideoPipeline"):
        engine.generate("x", FAMILY.params(true_cfg_scale=2.0), images=[[FRAME]])
    assert not engine.has_unfinished_requests()
    spec = engine.model_spec
    assert spec.edit_size(((24, 40),)) == (32, 32)  # no size set: the (tiny) folder's default, not the image's
    assert spec.latent_shape(32, 32, 9) == (MADE_SIZE + AUDIO_FRAMES * AUDIO_FEATURES,)


def test_the_first_frame_and_the_sound_cross_the_wire_once_per_answer(ltx2_i2v):
    engine, _, _ = ltx2_i2v
    outputs = engine.generate(
        "a red square", FAMILY.params(num_inference_steps=2, num_samples=2, seed=9), images=[[FRAME]]
    )
    first, second = over_the_wire(outputs)  # one answer's stream
    assert first.trajectory.condition.images is second.trajectory.condition.images  # decoded once, shared
    assert torch.equal(first.trajectory.condition.images.tokens, outputs[0].trajectory.condition.images.tokens)
    assert torch.equal(first.video, outputs[0].video) and torch.equal(first.audio, outputs[0].audio)
