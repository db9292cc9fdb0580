"""LTX-2 (`LTX2Pipeline`: a video and its sound denoised together) through the family contract. A
sample's latents are one vector, the video's packed tokens then the audio's packed frames: the ODE
path gives `LTX2Pipeline`'s final video and audio latents, frames and waveform; re-scoring covers
both parts and gives ratio 1; a sample does not depend on its batch-mates; sizes and frame counts
the pipeline refuses are refused at admission; the audio reaches the output and the wire."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout import SamplingParams
from rollout.rescoring import recompute_log_probs
from rollout.step_series import StepSeries
from tests.families import AUDIO_VIDEO_FAMILIES
from tests.rollout.pipelines.family_checks import (
    assert_ratio_one,
    assert_same_sample,
    engine_and_pipeline,
    over_the_wire,
    pipeline_schedule,
)

pytestmark = pytest.mark.timeout(180)

FAMILY = AUDIO_VIDEO_FAMILIES["ltx2"]
# The tiny VAE halves space and time: 9 frames of 32x32 are 5 x 16 x 16 tokens of 4 channels; the
# audio VAE's 25 latent frames a second give round(9 / 24 * 25) = 9 frames of 2 channels x 2 bins.
VIDEO_TOKENS, VIDEO_FEATURES, AUDIO_FRAMES, AUDIO_FEATURES = 5 * 16 * 16, 4, 9, 4
LENGTH = {"max_sequence_length": 64}


@pytest.fixture(scope="module")
def ltx2(tiny_models):
    """(engine, the diffusers pipeline, a trainer's adapter) on the same tiny folder."""
    with engine_and_pipeline(FAMILY, tiny_models(FAMILY.name), max_batch_size=16) as setup:
        yield setup


def pipeline_latents(pipeline, latents: torch.Tensor) -> dict:
    """A trajectory entry [N] as LTX2Pipeline's `latents=` (packed video tokens, taken as they are)
    and `audio_latents=` (packed audio frames, which the pipeline normalises: so denormalised here)."""
    video = latents[: VIDEO_TOKENS * VIDEO_FEATURES].reshape(1, VIDEO_TOKENS, VIDEO_FEATURES)
    audio = latents[VIDEO_TOKENS * VIDEO_FEATURES :].reshape(1, AUDIO_FRAMES, AUDIO_FEATURES)
    stats = pipeline.audio_vae
    return {"latents": video.clone(), "audio_latents": audio * stats.latents_std + stats.latents_mean}


def final_as_pipeline_output(pipeline, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A final entry [N] as LTX2Pipeline returns it with output_type="latent": the video unpacked
    and denormalised [1, C, F', h, w], the audio denormalised and unpacked [1, C, L, M]."""
    parts = pipeline_latents(pipeline, latents)
    vae = pipeline.vae
    video = pipeline._unpack_latents(parts["latents"], 5, 16, 16, 1, 1)
    video = pipeline._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    audio = pipeline._unpack_audio_latents(parts["audio_latents"], AUDIO_FRAMES, num_mel_bins=2)
    return video, audio


def call(params: SamplingParams, steps: int) -> dict:
    return {
        "prompt": "a red square",
        "height": 32,
        "width": 32,
        "num_frames": 9,
        "num_inference_steps": steps,
        "guidance_scale": params.guidance_scale,
        **LENGTH,
        **FAMILY.pipeline_extra,
    }


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_ode_rollout_video_and_audio_equal_ltx2_pipeline(ltx2, cfg):
    engine, pipeline, _ = ltx2
    params = FAMILY.params(cfg=cfg, sampler="ode", num_inference_steps=6, seed=3, **LENGTH)
    (output,) = engine.generate("a red square", params)
    t = output.trajectory
    assert t.latents[0].shape == (VIDEO_TOKENS * VIDEO_FEATURES + AUDIO_FRAMES * AUDIO_FEATURES,)
    initial = pipeline_latents(pipeline, t.latents[0])
    reference = pipeline(**call(params, 6), **initial, output_type="latent")
    video, audio = final_as_pipeline_output(pipeline, t.latents[-1])
    assert (video - reference.frames).abs().max() < 1e-4
    assert (audio - reference.audio).abs().max() < 1e-4

    decoded = pipeline(**call(params, 6), **pipeline_latents(pipeline, t.latents[0]), output_type="np")
    frames = torch.from_numpy((decoded.frames[0] * 255).round().astype("uint8")).permute(0, 3, 1, 2)
    assert output.video.shape == (9, 3, 32, 32) and output.image is None
    assert (output.video.int() - frames.int()).abs().max() <= 1
    assert output.audio.shape == decoded.audio[0].shape and output.audio.dtype == torch.float32
    assert (output.audio - decoded.audio[0].float()).abs().max() < 1e-4
    assert output.audio_sample_rate == pipeline.vocoder.config.output_sampling_rate


def test_schedule_and_trainer_sigmas_are_the_pipelines(ltx2):
    """The shift follows the video's token count (so the frame count): 9 and 17 frames differ, and
    each equals the pipeline's; a trainer's `sigmas` are the pipeline's `sigmas=`."""
    engine, pipeline, _ = ltx2
    schedules = []
    for frames, sigmas in ((9, None), (17, None), (9, (1.0, 0.8, 0.45, 0.2))):
        params = FAMILY.params(
            sampler="ode", num_inference_steps=4, seed=0, num_frames=frames, sigmas=sigmas, **LENGTH
        )
        (output,) = engine.generate("x", params)
        arguments = call(params, 4) | {"prompt": "x", "num_frames": frames, "output_type": "latent"}
        arguments["sigmas"] = None if sigmas is None else list(sigmas)
        expected_sigmas, expected_timesteps = pipeline_schedule(pipeline, **arguments)
        assert torch.equal(output.trajectory.sigmas, expected_sigmas.float())
        assert torch.equal(output.trajectory.timesteps, expected_timesteps.float())
        schedules.append(output.trajectory.sigmas)
    assert not torch.equal(schedules[0], schedules[1])


@pytest.mark.parametrize("sampler", ["flow_sde", "cps", "dance_sde"])
def test_rescoring_gives_ratio_one(ltx2, sampler):
    engine, _, trainer_adapter = ltx2
    params = FAMILY.params(cfg=True, sampler=sampler, noise_level=0.5, num_inference_steps=4, num_samples=2, seed=1)
    assert_ratio_one(trainer_adapter, engine.generate(["a red square", "a blue circle"], params))


def test_the_log_prob_of_a_step_covers_the_video_and_the_audio(ltx2):
    """A transition's log-prob is the Gaussian log-density averaged over every element of the
    joint vector: moving the audio part of x_{i+1} alone changes it, as moving the video part does."""
    engine, _, trainer_adapter = ltx2
    params = FAMILY.params(sampler="flow_sde", noise_level=0.7, num_inference_steps=3, seed=5, record=("mean", "std"))
    (output,) = engine.generate("a red square", params)
    t = output.trajectory
    step = 1
    mean, std = t.records["mean"][step], t.records["std"][step]
    x_next = t.latents[step + 1]
    density = torch.distributions.Normal(mean.double(), std.double()).log_prob(x_next.double()).mean()
    assert abs(float(density) - float(t.log_probs[step])) < 1e-5
    split = VIDEO_TOKENS * VIDEO_FEATURES
    for part in (slice(None, split), slice(split, None)):
        moved = t.latents.stack().clone()
        moved[step + 1, part] += 0.5 * std
        changed = dataclasses.replace(t, latents=StepSeries(range(len(moved)), [moved], len(moved)))
        delta = recompute_log_probs(trainer_adapter, changed)[step] - t.log_probs[step]
        assert delta < -1e-4, part


def test_a_sample_alone_equals_the_sample_in_a_mixed_batch(ltx2):
    """Other prompts, frame counts (so other audio lengths), guidance and samplers in flight."""
    engine, _, _ = ltx2
    alone_params = FAMILY.params(cfg=True, num_inference_steps=4, seed=21)
    (alone,) = engine.generate("red", alone_params)
    crowd_params = [
        FAMILY.params(cfg=True, num_inference_steps=4, seed=21, num_samples=2),
        FAMILY.params(cfg=False, num_inference_steps=4, seed=21, num_samples=2, sampler="cps", num_frames=13),
        FAMILY.params(cfg=True, num_inference_steps=6, seed=21, num_samples=2, sampler="dance_sde", noise_level=0.3),
    ]
    crowd = engine.generate(
        ["red", "a long prompt about a green circle in a wide field at noon", "blue"], crowd_params
    )
    assert_same_sample(alone, crowd[0])
    assert crowd[2].video.shape == (13, 3, 32, 32) and crowd[2].audio.shape[-1] > crowd[0].audio.shape[-1]


def test_sizes_frames_and_fields_the_pipeline_refuses_are_refused_at_admission(ltx2):
    engine, _, _ = ltx2
    refused = [
        ({"height": 48}, r"height=48 is not divisible by 32 \(.*LTX2Pipeline's own rule: multiples of 32\)"),
        ({"num_frames": 8}, r"num_frames=8 does not fit LTX2Pipeline's VAE, .* e.g. num_frames=9"),
        ({"num_inference_steps": 1}, "num_inference_steps=1 is too few for LTX2Pipeline"),
        ({"true_cfg_scale": 2.0}, "true_cfg_scale is not used by LTX2Pipeline"),
        ({"guidance_scale": 1.0, "negative_prompt": "ugly"}, "negative_prompt is used only with classifier-free"),
    ]
    for fields, message in refused:
        with pytest.raises(ValueError, match=message):
            engine.generate("x", SamplingParams(**{"height": 32, "width": 32, "num_frames": 9, **fields}))
    assert not engine.has_unfinished_requests()
    resolved, problems = engine.model_spec.resolve(SamplingParams(height=32, width=32))
    # The tiny folder's own 9 frames (sampling_defaults.json) in place of the pipeline's 121.
    assert problems == [] and (resolved.guidance_scale, resolved.negative_prompt, resolved.num_frames) == (
        3.0,
        "",
        9,
    )


def test_video_and_audio_cross_the_wire_bitwise(ltx2):
    engine, _, _ = ltx2
    outputs = engine.generate("a red square", FAMILY.params(cfg=True, num_inference_steps=2, num_samples=2, seed=9))
    for got, expected in zip(over_the_wire(outputs), outputs, strict=True):
        assert torch.equal(got.video, expected.video) and torch.equal(got.audio, expected.audio)
        assert got.audio_sample_rate == expected.audio_sample_rate == 16000
        assert torch.equal(got.trajectory.latents.stack(), expected.trajectory.latents.stack())


def test_a_reward_reads_the_frames_and_the_sound(ltx2):
    """A group's rewards get the videos as `images` and each sample's waveform in its metadata, in
    process and through the reward workers' and service's wire."""
    from trainers_adapters.rewards.builtin import audio_loudness, colour_agreement
    from trainers_adapters.rewards.rewarded_rollout import group_inputs
    from trainers_adapters.rewards.wire import decode_group, encode_group

    engine, _, _ = ltx2
    outputs = engine.generate("a red square", FAMILY.params(num_inference_steps=2, num_samples=2, seed=4))
    videos, prompts, metadata = group_inputs(outputs, None)
    assert videos.shape == (2, 9, 3, 32, 32)
    assert all(
        torch.equal(m["audio"], o.audio) and m["audio_sample_rate"] == 16000
        for m, o in zip(metadata, outputs, strict=True)
    )
    loudness = audio_loudness(videos, prompts, metadata)
    assert torch.equal(loudness, torch.stack([o.audio.pow(2).mean().sqrt() for o in outputs]))
    sent_videos, _, sent = decode_group(encode_group(videos, prompts, metadata))
    assert torch.equal(audio_loudness(sent_videos, prompts, sent), loudness)
    assert torch.equal(colour_agreement(sent_videos, prompts, sent), colour_agreement(videos, prompts, metadata))
    with pytest.raises(ValueError, match="audio_loudness scores sound, but samples \\[0, 1\\] carry no audio"):
        audio_loudness(videos, prompts, [{}, {}])
