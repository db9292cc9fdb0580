"""Admission by work on a real engine (issue 50, finding 1): what the tiny FLUX.1 Kontext's units of
work cost, as its worker measures them at start, and the requests whose longest unit would outlast
a quarter of the step timeout refused before anything runs, naming the limit and the size that
fits. The budget's arithmetic over made-up profiles: test_work_budget.py."""

from __future__ import annotations

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from tests.families import FAMILIES, input_image

pytestmark = pytest.mark.timeout(180)

KONTEXT = FAMILIES["flux_kontext"]


@pytest.fixture(scope="module")
def kontext_engine(tiny_models):
    """The tiny FLUX.1 Kontext at the finding's step timeout: a unit of work may take 3.75 s."""
    config = EngineConfig(model=tiny_models("flux_kontext"), step_timeout_s=15.0)
    with RolloutEngine(config) as engine:
        yield engine


def units_by_name(engine) -> dict[str, object]:
    return {(unit.phase, unit.name): unit for unit in engine.work_budget.profile.units}


def test_the_worker_measures_each_unit_s_work_exactly_and_its_device_s_speed(kontext_engine):
    units = units_by_name(kontext_engine)
    # The VAE's mid-block attention over the latent's pixels (a quarter of the image's: its VAE scales
    # by 2), 16 channels: 4 * 16 * (pixels / 4)^2 = 4 pixels^2 FLOPs, in encoding and in decoding.
    for phase, where in (("encode", "encoder"), ("decode", "decoder")):
        attention = units[(phase, f"vae: {where}.mid_block.attentions.0")].attention
        assert attention == pytest.approx((0.0, 0.0, 4.0), abs=1e-6)
    # Each resnet is a unit of its own, linear in pixels; the text encoders' layers do the same at any size.
    assert units[("decode", "vae: decoder.up_blocks.1.resnets.1")].other[2] == pytest.approx(0.0, abs=1e-9)
    assert units[("encode", "text_encoder: encoder.layers.0")].other[1:] == (0.0, 0.0)
    # A forward's block attends over the output's and the input image's tokens (a 16th of the pixels
    # each: VAE scale 2, 2 x 2 packing) and the 512 text tokens; its attention's width is 32.
    block = units[("denoise", "transformer: transformer_blocks.0")]
    assert block.attention == pytest.approx((4 * 32 * 512**2, 2 * 4 * 32 * 512 / 16, 4 * 32 / 16**2), rel=1e-9)
    profile = kontext_engine.work_budget.profile
    assert profile.attention_flops_per_s > 1e8 and profile.other_flops_per_s > 1e8 and profile.device == "cpu"


def test_a_text_only_request_too_big_for_the_step_timeout_is_refused_before_anything_runs(kontext_engine):
    # The finding: a 768 x 768 text-only request ran the VAE's mid-block attention for ~50 s in one
    # unit, and the engine died at a 15 s step timeout. Estimated here at 50-600 s (by the load).
    count = kontext_engine.collective_rpc(lambda worker: worker.progress.count)[0]
    params = KONTEXT.params(num_inference_steps=2, height=768, width=768)
    with pytest.raises(ValueError) as refused:
        kontext_engine.generate("x", params)
    message = str(refused.value)
    assert "a request of 768x768 would run one unit of work (vae: decoder.mid_block.attentions.0) for about" in message
    assert "more than the 3.75 s a unit may take: a quarter of step_timeout_s=15" in message
    assert "ask for at most about" in message and "or raise step_timeout_s" in message
    assert kontext_engine.collective_rpc(lambda worker: worker.progress.count)[0] == count  # nothing ran
    assert not kontext_engine.has_unfinished_requests()
    (output,) = kontext_engine.generate("x", KONTEXT.params(num_inference_steps=2, seed=0))  # the engine serves on
    assert output.status == "finished" and kontext_engine.dead is None


def test_an_input_image_too_big_for_the_step_timeout_is_refused_by_its_size(kontext_engine):
    # The finding's other case: 4088 x 4088 beside a 32 x 32 output is within the default max_pixels.
    params = KONTEXT.params(num_inference_steps=2, height=32, width=32)
    with pytest.raises(ValueError, match=r"\(vae: encoder.mid_block.attentions.0\).*send input images of at most"):
        kontext_engine.check_requests(["x"], params, [[(4088, 4088)]])
    big = torch.zeros(3, 4088, 4088, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"a quarter of step_timeout_s=15 .*send input images of at most about"):
        kontext_engine.generate("x", params, images=[[big]])
    assert not kontext_engine.has_unfinished_requests()
    (output,) = kontext_engine.generate("x", params, images=[[input_image(0)]])
    assert output.status == "finished"
