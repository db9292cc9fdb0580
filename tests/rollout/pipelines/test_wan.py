"""Wan 2.1 and Wan 2.2 (two experts) through the family contract: the ODE path and the frames are
`WanPipeline`'s, re-scoring gives ratio 1 for every SDE sampler, samples do not depend on what
shares their batch (other frame counts and prompts included), and trees and records work on video.
(Image-to-video, `WanImageToVideoPipeline`: test_wan_i2v.py.)"""

from __future__ import annotations

import pytest
import torch
from diffusers import WanPipeline

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.loading import load_adapter
from tests.families import TEXT_TO_VIDEO_FAMILIES
from tests.rollout.pipelines.family_checks import assert_ratio_one, family_engines, over_the_wire

VIDEO_FAMILIES = {name: f for name, f in TEXT_TO_VIDEO_FAMILIES.items() if f.pipeline_class == "WanPipeline"}

pytestmark = pytest.mark.timeout(180)


wan = family_engines(VIDEO_FAMILIES)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_ode_rollout_and_frames_equal_wan_pipeline(wan, cfg):
    family, engine, pipeline, _ = wan
    params = family.params(cfg=cfg, sampler="ode", num_inference_steps=6, seed=3)
    (output,) = engine.generate("a red square", params)
    t = output.trajectory
    assert t.latents[0].shape == (4, 5, 16, 16)  # [C, F', h, w]: 9 frames are 5 latent frames
    assert t.num_frames == 9 and output.image is None
    if family.name == "wan22":  # the schedule crosses the boundary (875): both experts ran
        assert t.timesteps.max() >= 875 > t.timesteps.min()
    call = {"num_inference_steps": 6, "height": 32, "width": 32, "num_frames": 9, **params_of(params)}
    initial = t.latents[0][None]
    reference = pipeline("a red square", latents=initial.clone(), output_type="latent", **call).frames
    assert (t.latents[-1] - reference[0]).abs().max() < 1e-4
    frames = pipeline("a red square", latents=initial.clone(), output_type="np", **call).frames
    reference_uint8 = torch.from_numpy((frames[0] * 255).round().astype("uint8")).permute(0, 3, 1, 2)
    assert output.video.shape == (9, 3, 32, 32) and output.video.dtype == torch.uint8
    assert (output.video.int() - reference_uint8.int()).abs().max() <= 1


def params_of(params: SamplingParams) -> dict:
    """The guidance arguments `WanPipeline` takes for these (resolved or not) params."""
    call = {"guidance_scale": params.guidance_scale}
    if params.guidance_scale_2 is not None:
        call["guidance_scale_2"] = params.guidance_scale_2
    return call


def test_the_two_experts_and_their_guidance_act_on_their_own_steps(wan):
    family, engine, _, _ = wan
    if family.name != "wan22":
        pytest.skip("Wan 2.2 only")
    base = family.params(cfg=True, sampler="ode", num_inference_steps=6, seed=3)
    (plain,) = engine.generate("x", base)
    (low_changed,) = engine.generate("x", SamplingParams(**{**base.__dict__, "guidance_scale_2": 7.0}))
    a, b = plain.trajectory.latents.stack(), low_changed.trajectory.latents.stack()
    high_steps = int((plain.trajectory.timesteps >= 875).sum())  # the first steps: high noise
    assert torch.equal(a[: high_steps + 1], b[: high_steps + 1])  # guidance_scale_2 leaves them alone
    assert not torch.equal(a[-1], b[-1])


@pytest.mark.parametrize("sampler", ["flow_sde", "cps", "dance_sde"])
def test_rescoring_gives_ratio_one(wan, sampler):
    family, engine, _, trainer_adapter = wan
    params = family.params(cfg=True, sampler=sampler, noise_level=0.5, num_inference_steps=4, num_samples=2, seed=1)
    assert_ratio_one(trainer_adapter, engine.generate(["a red square", "a blue circle"], params))


def test_samples_do_not_depend_on_their_batch_mates(wan):
    family, engine, _, _ = wan
    short = family.params(num_inference_steps=3, seed=4)
    long = family.params(num_inference_steps=3, seed=4, num_frames=13)
    (alone,) = engine.generate("a red square", short)
    # Prompt index 0 again (seeds follow it), with other prompts and frame counts in flight.
    crowd = engine.generate(["a red square", "other", "more", "else"], [short, long, short, long])
    assert (alone.trajectory.latents.stack() - crowd[0].trajectory.latents.stack()).abs().max() < 1e-5
    assert crowd[0].video.shape == (9, 3, 32, 32) and crowd[1].video.shape == (13, 3, 32, 32)


def test_frame_counts_the_vae_cannot_take_are_refused_with_the_nearest(wan):
    family, engine, _, _ = wan
    with pytest.raises(ValueError, match=r"num_frames=8 does not fit WanPipeline's VAE, .* e.g. num_frames=9"):
        engine.generate("x", family.params(num_frames=8))
    if family.name == "wan":
        with pytest.raises(ValueError, match="guidance_scale_2 is not used by WanPipeline"):
            engine.generate("x", family.params(guidance_scale_2=2.0))


def test_sizes_and_frames_past_the_rotary_table_are_refused_at_admission(wan):
    """The tiny transformer's rope_max_seq_len is 64 tokens per axis: WanPipeline's default 480x832
    (which the tiny folder's own 32x32 replaces) is past it. Refused before anything is queued (it
    failed in the worker with a shape error)."""
    family, engine, _, _ = wan
    with pytest.raises(ValueError, match=r"height=480 is above the 256 pixels .*rope_max_seq_len 64 tokens"):
        engine.generate("x", SamplingParams(height=480, width=832, num_frames=9))
    with pytest.raises(ValueError, match=r"num_frames=129 is above the 127 frames"):
        engine.generate("x", family.params(num_frames=129))
    assert not engine.has_unfinished_requests()
    assert engine.generate("x", family.params(num_frames=127, num_inference_steps=1))[0].status == "finished"


def test_trees_and_records_on_video_latents(wan):
    family, engine, _, trainer_adapter = wan
    params = family.params(
        num_inference_steps=4, seed=6, branch_steps=(1,), branch_factor=2, record=("x0", "mean"), output_type="latent"
    )
    leaves = engine.generate("a red square", params)
    assert [o.branch_path for o in leaves] == [(0,), (1,)]
    a, b = (o.trajectory.latents.stack() for o in leaves)
    assert torch.equal(a[:2], b[:2]) and not torch.equal(a[2], b[2])
    assert leaves[0].trajectory.latents.parts[0] is leaves[1].trajectory.latents.parts[0]
    assert leaves[0].latents.shape == (4, 5, 16, 16) and leaves[0].video is None
    assert leaves[0].trajectory.records["x0"][3].shape == (4, 5, 16, 16)
    assert_ratio_one(trainer_adapter, leaves)


EXPERTS = ("transformer", "transformer_2")


def test_a_batch_never_mixes_experts(wan):
    """A request past the boundary and one before it share a batch; each expert's forward gets
    only the rows on its own side (a single forward would see timesteps from both)."""
    family, engine, _, _ = wan
    if family.name != "wan22":
        pytest.skip("Wan 2.2 only")
    calls = []

    def record(worker):
        for name in EXPERTS:
            expert = getattr(worker.adapter.pipeline, name)

            def counted(*args, _name=name, _forward=expert.forward, **kwargs):
                calls.append((_name, kwargs["timestep"].tolist()))
                return _forward(*args, **kwargs)

            expert.forward = counted  # an instance attribute: shadows the class's forward

    def restore(worker):
        for name in EXPERTS:
            del vars(getattr(worker.adapter.pipeline, name))["forward"]

    engine.collective_rpc(record)
    try:
        params = family.params(cfg=True, num_inference_steps=6, seed=2)
        engine.add_request("early", params)
        for _ in range(3):  # "early" is past the boundary now (step 3 of 6: timestep 668)
            engine.step()
        engine.add_request("late", params)  # joins the batch at timestep 1000
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.collective_rpc(restore)
    assert {name for name, _ in calls} == set(EXPERTS)
    for name, timesteps in calls:
        assert all((t >= 875) == (name == "transformer") for t in timesteps), (name, timesteps)


def test_the_expert_chosen_on_the_host_is_the_one_the_device_chooses(wan):
    """The engine's step picks each row's expert from its sigma as a Python float (no device read);
    a trainer's tensor of sigmas picks on the device. Both give the same rows, at the boundary, a
    float32 step to either side of it, and far from it."""
    family, _, _, adapter = wan
    if family.name != "wan22":
        pytest.skip("Wan 2.2 only")
    boundary = torch.tensor(adapter.boundary_timestep / 1000, dtype=torch.float32)
    near = [torch.nextafter(boundary, torch.tensor(v)) for v in (0.0, 2.0)]
    sigmas = torch.stack([boundary, *near, torch.tensor(1.0), torch.tensor(0.1), boundary])
    timestep = sigmas * adapter._scheduler.config.num_train_timesteps

    def chosen(groups) -> list[tuple[int, list[int]]]:
        rows = torch.arange(len(sigmas))
        return [(id(expert), rows[index].tolist()) for expert, index in groups]

    on_host = chosen(adapter._rows_by_expert(timestep, sigmas.tolist()))
    assert on_host == chosen(adapter._rows_by_expert(timestep, None))
    assert len(on_host) == 2


def test_videos_cross_the_wire_bitwise(wan):
    family, engine, _, _ = wan
    outputs = engine.generate("a red square", family.params(cfg=True, num_inference_steps=2, num_samples=2, seed=9))
    for got, expected in zip(over_the_wire(outputs), outputs, strict=True):
        assert torch.equal(got.video, expected.video) and got.image is None
        assert torch.equal(got.trajectory.latents.stack(), expected.trajectory.latents.stack())
        for name in ("num_frames", "guidance_scale", "guidance_scale_2"):
            assert getattr(got.trajectory, name) == getattr(expected.trajectory, name)


def _spy_on_timesteps(transformer, shapes: list) -> None:
    """Record the shape of every timestep `transformer` is called with (an instance attribute
    shadows the class's forward)."""

    def spied(*args, _forward=transformer.forward, **kwargs):
        shapes.append(tuple(kwargs["timestep"].shape))
        return _forward(*args, **kwargs)

    transformer.forward = spied


def test_ti2v_layout_takes_one_timestep_per_token_as_wan_pipeline_does(tmp_path):
    """Wan 2.2 TI2V-5B (`expand_timesteps`): the transformer gets a timestep per latent token.
    With one per row instead, the latents still come within 1.3e-6 of the pipeline's, so the
    timesteps' shapes are checked too."""
    from rollout.pipelines.tiny import build_tiny_wan22_ti2v

    path = build_tiny_wan22_ti2v(tmp_path / "ti2v")
    pipeline = WanPipeline.from_pretrained(path)
    pipeline.set_progress_bar_config(disable=True)
    params = SamplingParams(
        height=32, width=32, num_frames=9, guidance_scale=4.0, sampler="ode", num_inference_steps=4
    )
    with RolloutEngine(EngineConfig(model=str(path))) as engine:
        engine_shapes: list = []
        engine.collective_rpc(lambda worker: _spy_on_timesteps(worker.adapter.pipeline.transformer, engine_shapes))
        (output,) = engine.generate("a red square", params)
        t = output.trajectory
        assert t.latents[0].shape == (8, 5, 8, 8)  # 48 channels and 16x space in the real model
        pipeline_shapes: list = []
        _spy_on_timesteps(pipeline.transformer, pipeline_shapes)
        call = {"num_inference_steps": 4, "height": 32, "width": 32, "num_frames": 9, "guidance_scale": 4.0}
        reference = pipeline("a red square", latents=t.latents[0][None].clone(), output_type="latent", **call)
        assert (t.latents[-1] - reference.frames[0]).abs().max() < 1e-4
        tokens = 5 * 4 * 4  # latent frames x (8 / 2) x (8 / 2) patches
        assert set(engine_shapes) == set(pipeline_shapes) == {(1, tokens)}  # CFG: two passes of one row
        assert output.video.shape == (9, 3, 32, 32)

        trainer_adapter = load_adapter(str(path))
        sde = SamplingParams(**{**params.__dict__, "sampler": "flow_sde", "noise_level": 0.5, "num_samples": 2})
        assert_ratio_one(trainer_adapter, engine.generate("a red square", sde))
