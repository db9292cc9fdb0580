"""HunyuanVideo 1.5, text-to-video (`HunyuanVideo15Pipeline`) and image-to-video
(`HunyuanVideo15ImageToVideoPipeline`: the first frame is the request's input image), through the
family contract: the ODE path and the frames are the pipeline's given the same initial latents (and
frame), with glyph text too; CFG is the pipeline guider's scale; re-scoring gives ratio 1; a sample
does not depend on its batch; the first frame is encoded once per (image, size, frames) and held
once by a group; requests the model cannot take (frames, sizes, guidance below 1, a size other
than the frame's bucket) are refused at admission with the rule named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout import SamplingParams
from rollout.input_images import InputImages
from rollout.pipelines.families.hunyuan_video15.tiny import HUNYUAN15_GUIDANCE
from tests.families import VIDEO_FAMILIES, input_image
from tests.rollout.pipelines.family_checks import assert_ratio_one, family_engines
from tests.rollout.pipelines.first_frames import assert_one_first_frame_is_required

pytestmark = pytest.mark.timeout(180)

HUNYUAN = {name: f for name, f in VIDEO_FAMILIES.items() if f.pipeline_class.startswith("HunyuanVideo15")}
FRAME = input_image(0, 24, 40)  # not square: the image-to-video pipeline picks its 24x40 bucket
SQUARE = input_image(1)  # 32x32: the bucket of the tiny requests' 32x32 size
PROMPTS = ("a red square", 'a sign that says "HELLO"')  # the second reaches the ByT5 glyph encoder


hunyuan = family_engines(HUNYUAN)


def frames_of(family, *images) -> dict:
    """`generate`'s images= for an image-to-video family (one first frame per prompt), else nothing."""
    return {"images": [[image] for image in images]} if family.edits else {}


@pytest.mark.parametrize("prompt", PROMPTS, ids=["plain", "glyphs"])
@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_ode_rollout_and_frames_equal_the_pipeline(hunyuan, cfg, prompt):
    family, engine, pipeline, _ = hunyuan
    size = {"height": 24, "width": 40} if family.edits else {"height": 32, "width": 32}
    params = family.params(cfg=cfg, sampler="ode", num_inference_steps=5, seed=3, **size)
    (output,) = engine.generate(prompt, params, **frames_of(family, FRAME))
    t = output.trajectory
    assert t.latents[0].shape == (4, 5, size["height"] // 4, size["width"] // 4)  # [C, F', h, w]
    assert (t.condition.negative is not None) == cfg  # the guider's second pass, as the pipeline's
    # The pipeline takes no guidance argument: its guider holds the scale.
    pipeline.guider = pipeline.guider.new(guidance_scale=params.guidance_scale)
    call = {"num_inference_steps": 5, "num_frames": 9, "latents": t.latents[0][None]}
    if family.edits:  # no size: the pipeline makes the frame's bucket, 24x40
        call["image"] = InputImages.of([FRAME]).pil()[0]
    else:
        call |= size
    reference = pipeline(prompt=prompt, output_type="latent", **{**call, "latents": t.latents[0][None].clone()})
    assert (t.latents[-1] - reference.frames[0]).abs().max() < 1e-4
    frames = pipeline(prompt=prompt, output_type="np", **{**call, "latents": t.latents[0][None].clone()}).frames
    reference_uint8 = torch.from_numpy((frames[0] * 255).round().astype("uint8")).permute(0, 3, 1, 2)
    assert output.video.shape == (9, 3, size["height"], size["width"])
    assert (output.video.int() - reference_uint8.int()).abs().max() <= 1


def test_schedule_and_trainer_sigmas_are_the_pipelines(hunyuan):
    family, engine, pipeline, _ = hunyuan
    sigmas = (1.0, 0.7, 0.4, 0.1)
    params = family.params(sampler="ode", num_inference_steps=4, seed=4, sigmas=sigmas)
    (output,) = engine.generate("x", params, **frames_of(family, SQUARE))
    pipeline.guider = pipeline.guider.new(guidance_scale=1.0)
    call = {"num_inference_steps": 4, "num_frames": 9, "sigmas": list(sigmas), "output_type": "latent"}
    call |= {"image": InputImages.of([SQUARE]).pil()[0]} if family.edits else {"height": 32, "width": 32}
    reference = pipeline(prompt="x", latents=output.trajectory.latents[0][None].clone(), **call).frames
    assert torch.allclose(output.trajectory.sigmas, pipeline.scheduler.sigmas.float())
    assert torch.allclose(output.trajectory.timesteps, pipeline.scheduler.timesteps.float())
    assert (output.trajectory.latents[-1] - reference[0]).abs().max() < 1e-4


@pytest.mark.parametrize("sampler", ["flow_sde", "cps"])
def test_rescoring_gives_ratio_one(hunyuan, sampler):
    family, engine, _, trainer_adapter = hunyuan
    params = family.params(cfg=True, sampler=sampler, noise_level=0.5, num_inference_steps=4, num_samples=2, seed=1)
    outputs = engine.generate(list(PROMPTS), params, **frames_of(family, SQUARE, input_image(2)))
    assert_ratio_one(trainer_adapter, outputs)


def test_samples_do_not_depend_on_their_batch_mates(hunyuan):
    family, engine, _, _ = hunyuan
    short = family.params(cfg=True, num_inference_steps=3, seed=4)
    long = family.params(num_inference_steps=3, seed=4, num_frames=13)
    (alone,) = engine.generate("a red square", short, **frames_of(family, SQUARE))
    # Prompt index 0 again (seeds follow it), with other prompts (glyphs too), frames and frame counts.
    prompts = ["a red square", PROMPTS[1], "more", "else"]
    crowd = engine.generate(
        prompts, [short, short, long, short], **frames_of(family, SQUARE, *map(input_image, (2, 3, 4)))
    )
    assert (alone.trajectory.latents.stack() - crowd[0].trajectory.latents.stack()).abs().max() < 1e-5
    assert crowd[0].video.shape == (9, 3, 32, 32) and crowd[2].video.shape == (13, 3, 32, 32)


def test_guidance_is_the_guiders_scale(hunyuan):
    """A request's guidance_scale defaults to the folder's guider's (6.0: on), 1 is off, and a scale
    below 1 (which the guider would guide with) is refused."""
    family, engine, _, _ = hunyuan
    assert engine.model_spec.guidance_defaults == {"guidance_scale": HUNYUAN15_GUIDANCE}  # the saved guider's
    images = frames_of(family, SQUARE)
    (guided,) = engine.generate("x", SamplingParams(num_frames=9, num_inference_steps=1, **sizes(family)), **images)
    assert guided.trajectory.condition.negative is not None
    with pytest.raises(ValueError, match=r"guidance_scale=0.5 is below 1: .*guider would guide with it"):
        engine.generate("x", family.params(guidance_scale=0.5), **images)
    with pytest.raises(ValueError, match="max_sequence_length is not used by HunyuanVideo15"):
        engine.generate("x", family.params(max_sequence_length=64), **images)


def sizes(family) -> dict:
    return {} if family.edits else {"height": 32, "width": 32}


def test_frames_and_sizes_the_model_cannot_take_are_refused_at_admission(hunyuan):
    family, engine, _, _ = hunyuan
    images = frames_of(family, SQUARE)
    model = family.pipeline_class
    with pytest.raises(ValueError, match=rf"num_frames=8 does not fit {model}'s VAE, .* e.g. num_frames=9"):
        engine.generate("x", family.params(num_frames=8), **images)
    with pytest.raises(ValueError, match=r"height=34 is not divisible by 4"):
        engine.generate("x", family.params(height=34, width=32), **images)
    assert not engine.has_unfinished_requests()


def test_the_first_frame_sets_the_size_and_is_encoded_once_per_group(hunyuan):
    family, engine, _, _ = hunyuan
    if not family.edits:
        pytest.skip("image-to-video only")
    calls = []

    def count(worker):
        adapter = worker.adapter

        def counted(images, _encode=adapter.encode_images):
            calls.append((images.setting("height", None), images.setting("width", None)))
            return _encode(images)

        adapter.encode_images = counted  # an instance attribute: shadows the class's method

    engine.collective_rpc(count)
    try:
        params = SamplingParams(num_frames=9, num_inference_steps=2, num_samples=3, seed=5, guidance_scale=1.0)
        group = engine.generate(["a", "b"], params, images=[[FRAME], [FRAME]])
    finally:
        engine.collective_rpc(lambda worker: vars(worker.adapter).pop("encode_images"))
    assert calls == [(24, 40)]  # no size set: the 24x40 frame's bucket
    assert group[0].video.shape == (9, 3, 24, 40)
    first = group[0].trajectory.condition.images
    assert all(output.trajectory.condition.images is first for output in group)
    assert first.latents.shape == (4, 1, 6, 10) and first.image_embeds.shape == (16, 32)  # tiny SigLIP: 16 tokens
    with pytest.raises(
        ValueError, match=r"takes no size and makes the video .* nearest the frame's aspect ratio, 24x40"
    ):
        engine.generate("x", family.params(), images=[[FRAME]])  # 32x32 asked of a 24x40 frame
    assert_one_first_frame_is_required(engine, family.params(), SQUARE)
    assert not engine.has_unfinished_requests()


def test_unsupported_guiders_and_meanflow_are_refused_when_the_folder_loads(hunyuan):
    from diffusers import ClassifierFreeGuidance

    from rollout.pipelines.families.hunyuan_video15.adapter import HunyuanVideo15ImageToVideoAdapter, check_guider

    family, _, pipeline, _ = hunyuan
    check_guider(ClassifierFreeGuidance(guidance_scale=6.0), family.pipeline_class)  # the published one
    with pytest.raises(ValueError, match=r"guider is not supported: guidance_rescale=0.7; use_original_formulation"):
        check_guider(ClassifierFreeGuidance(guidance_rescale=0.7, use_original_formulation=True), "X")
    with pytest.raises(ValueError, match=r"start=0.2, stop=1.0 \(guidance on some steps only\)"):
        check_guider(ClassifierFreeGuidance(start=0.2), "X")
    if family.edits:
        pipeline.transformer.register_to_config(use_meanflow=True)
        try:
            with pytest.raises(ValueError, match="use_meanflow .* is not supported"):
                HunyuanVideo15ImageToVideoAdapter(pipeline)
        finally:
            pipeline.transformer.register_to_config(use_meanflow=False)


def test_the_size_a_first_frame_picks_is_the_pipelines_for_every_aspect_ratio(hunyuan):
    """`ModelSpec.first_frame_size` (admission's copy of the pipeline's bucket choice) against the
    pipeline's own `calculate_default_height_width`, at the published 640 and the tiny 32."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import (
        HunyuanVideo15ImageProcessor,
        generate_crop_size_list,
    )

    family, engine, _, _ = hunyuan
    if not family.edits:
        pytest.skip("image-to-video only")
    for target, scale in ((32, 4), (640, 16)):
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=scale)
        buckets = tuple(generate_crop_size_list(base_size=target, patch_size=scale))
        spec = dataclasses.replace(engine.model_spec, first_frame_sizes=buckets)
        for height, width in [(1, 1), (24, 40), (40, 24), (480, 832), (832, 480), (100, 1000), (1000, 100), (7, 9)]:
            expected = processor.calculate_default_height_width(height, width, target)
            assert spec.first_frame_size(height, width) == tuple(expected), (target, height, width)


def test_latent_channels_set_the_video_colour(hunyuan):
    """The tiny VAE's decoder paints latent channels 0, 1, 2 red, green, blue (through its DC-AE
    shortcuts), so a colour reward is learnable (a random decoder gives every latent one colour)."""
    _, _, _, adapter = hunyuan
    noise = torch.randn(4, 4, 5, 8, 8, generator=torch.Generator().manual_seed(0))

    def mean_colour(latents):
        return adapter.decode(latents, 32, 32).float().mean(dim=(0, 1, 3, 4)) / 255

    base = mean_colour(noise)
    for channel in range(3):
        shifted = noise.clone()
        shifted[:, channel] += 1.5
        change = mean_colour(shifted) - base
        others = [c for c in range(3) if c != channel]
        assert change[channel] > 0.1 and (change[others] < change[channel] / 2).all(), (channel, change)


def test_a_policys_lora_saves_without_a_pipeline_lora_loader_and_loads_into_the_engine(hunyuan, tiny_models, tmp_path):
    """HunyuanVideo 1.5's pipelines have no LoRA loader mixin (`save_lora_weights`): the policy
    writes diffusers' LoRA file through HunyuanVideo's, and the engine loads it."""
    from trainers_adapters.policy.lora_policy import LoraPolicy

    family, engine, _, _ = hunyuan
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_models(family.name), {"r": 4, "lora_alpha": 8})
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05)
    assert policy.save(tmp_path).name == "pytorch_lora_weights.safetensors"
    engine.load_lora("saved", str(tmp_path))
    try:
        params = family.params(num_inference_steps=2, seed=1)
        images = frames_of(family, SQUARE)
        (with_lora,) = engine.generate("x", dataclasses.replace(params, lora="saved"), **images)
        (without,) = engine.generate("x", params, **images)
    finally:
        engine.unload_lora("saved")
    assert not torch.equal(with_lora.trajectory.latents[-1], without.trajectory.latents[-1])
