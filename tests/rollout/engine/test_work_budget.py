"""Admission by work (`rollout.engine.work_budget`): a request whose longest unit of work would
outlast a quarter of the step timeout is refused with the size that fits, and batches of a size
hold only as many samples as fit. Over made-up work profiles, so every number is exact; the
engine's own measured profile: test_work_admission.py."""

from __future__ import annotations

import dataclasses
import math

import pytest

from rollout import NodeId, SamplingParams
from rollout.engine.request import Request
from rollout.engine.scheduler import Scheduler
from rollout.engine.work_budget import UNIT_SHARE, WorkBudget
from rollout.worker.work_profile import UnitWork, WorkProfile
from tests.executors.fake_executor import FAKE_SPEC

pytestmark = pytest.mark.timeout(30)

GFLOPS = 1e9
NONE = (0.0, 0.0, 0.0)
# A VAE's mid-block attention: 4 FLOPs per pair of pixels (the tiny FLUX.1 Kontext VAE's, per pixel of
# the image: 16 channels over the latent's quarter of its pixels); a transformer block: linear in pixels.
ATTENTION = UnitWork("vae: decoder.mid_block.attentions.0", "decode", attention=(0.0, 0.0, 4.0), other=NONE)
BLOCK = UnitWork("transformer: transformer_blocks.0", "denoise", attention=NONE, other=(0.0, 1e5, 0.0))
TEXT = UnitWork("text_encoder: encoder.layers.0", "encode", attention=NONE, other=(1e8, 0.0, 0.0))


def budget(*units: UnitWork, step_timeout_s: float = 15.0, max_batch_size: int = 16, **spec) -> WorkBudget:
    profile = WorkProfile(
        units=units,
        attention_flops_per_s=GFLOPS,
        other_flops_per_s=GFLOPS,
        latent_frames=1,
        cfg_in_one_pass=True,
        device="cpu",
    )
    return WorkBudget(profile, dataclasses.replace(FAKE_SPEC, **spec), step_timeout_s, max_batch_size)


def params(height: int, width: int, **fields) -> SamplingParams:
    return SamplingParams(height=height, width=width, **fields)


def test_a_request_whose_longest_unit_outlasts_a_quarter_of_the_timeout_is_refused_with_the_size_that_fits():
    work = budget(ATTENTION, BLOCK, TEXT)
    big = params(256, 256)  # 4 * 65536^2 FLOPs at 1 GFLOP/s: 17.2 s, past 15 / 4
    assert work.longest_units(big, ()).per_sample == pytest.approx((4 * 65536**2 / GFLOPS, ATTENTION.name))
    assert work.longest_units(big, ()).per_request == (0.1, TEXT.name)
    (problem,) = work.problems(big, ())
    assert problem.startswith(
        "a request of 256x256 would run one unit of work (vae: decoder.mid_block.attentions.0) for about 17.2 s "
        "(this engine's cpu measured 1 GFLOP/s in attention and 1 GFLOP/s in matrix products), more than the "
        "3.75 s a unit may take: a quarter of step_timeout_s=15 (EngineConfig.step_timeout_s; a server's "
        "--step-timeout-s)"
    )
    # The largest multiple of the size multiple (16) that fits: 160 (2.6 s); 176 is 3.8 s.
    assert problem.endswith("ask for at most about 160x160, or raise step_timeout_s")
    assert work.problems(params(160, 160), ()) == []
    assert work.problems(params(176, 176), ()) != []
    assert UNIT_SHARE == 0.25 and budget(ATTENTION, step_timeout_s=80.0).problems(big, ()) == []


def test_input_images_too_big_are_refused_with_the_pixels_that_fit_the_output_kept():
    encode = dataclasses.replace(ATTENTION, name="vae: encoder.mid_block.attentions.0", phase="encode")
    work = budget(encode, BLOCK, max_input_images=1)
    (problem,) = work.problems(params(32, 32), (4088 * 4088,))
    most = math.sqrt(3.75 * GFLOPS / 4)  # pixels whose 4 * pixels^2 FLOPs take 3.75 s
    assert f"send input images of at most about {most:.0f} pixels each as encoded" in problem
    assert work.problems(params(32, 32), (int(most) - 1,)) == []


def test_a_unit_of_the_text_encoders_that_does_not_fit_fits_at_no_size():
    work = budget(TEXT, step_timeout_s=0.2)
    (problem,) = work.problems(params(32, 32), ())
    assert "(text_encoder: encoder.layers.0) for about 0.1 s" in problem and "no size fits" in problem


def test_batches_of_a_size_hold_as_many_samples_as_fit():
    work = budget(BLOCK, step_timeout_s=4.0)  # a unit may take 1 s; a sample's block 0.2 s at 2000 pixels
    assert work.samples_per_batch(params(40, 50), ()) == 5
    assert work.samples_per_batch(params(40, 50, guidance_scale=4.5, negative_prompt=""), ()) == 2  # two rows each
    assert work.samples_per_batch(params(4, 4), ()) == 16  # max_batch_size
    assert work.samples_per_batch(params(400, 500), ()) == 1  # refused at admission anyway


def test_a_per_frame_unit_is_estimated_at_the_calibrations_frames_the_others_at_the_videos():
    decoder = dataclasses.replace(ATTENTION, attention=NONE, other=(0.0, 1e3, 0.0), per_frame=True)
    block = dataclasses.replace(BLOCK, other=(0.0, 1e3, 0.0))
    work = budget(decoder, block, default_num_frames=9, frame_multiple=4)
    profile = dataclasses.replace(work.profile, latent_frames=3)
    assert profile.seconds(decoder, 1000, latent_frames=21) == pytest.approx(1e3 * 1000 * 3 / GFLOPS)
    assert profile.seconds(block, 1000, latent_frames=21) == pytest.approx(1e3 * 1000 * 21 / GFLOPS)


def test_the_scheduler_keeps_every_batch_to_its_requests_max_batch():
    table = Scheduler(num_ranks=1, max_batch_size=8)
    for sample in range(5):
        table.add(
            Request(
                node_id=NodeId("big", sample),
                prompt="p",
                prompt_index=0,
                params=SamplingParams(num_inference_steps=2),
                seed=sample,
                init_noise_seed=0,
                base_seed=0,
                tree_id=sample,
                max_batch=2,
            )
        )
    batches = [table.schedule().worker_inputs[0].step_ids for _ in range(5)]
    assert [len(batch) for batch in batches] == [2, 2, 2, 2, 2]
    # In turns, the least recently and least stepped first: every request within the first three.
    assert {request_id for batch in batches[:3] for request_id in batch} == {f"big-{k}" for k in range(5)}
    assert sorted(request_id for batch in batches for request_id in batch) == sorted(
        [f"big-{k}" for k in range(5)] * 2
    )
