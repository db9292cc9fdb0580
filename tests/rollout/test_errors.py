"""Bad input fails before any work starts, with an error that names the field and the fix."""

from __future__ import annotations

import json
import re

import pytest

from rollout import EngineConfig, RolloutEngine, SamplingParams

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_inference_steps": 0}, "num_inference_steps must be an integer >= 1, got 0"),
        ({"sampler": "euler"}, "sampler must be one of .*'flow_sde'.*got 'euler'"),
        ({"noise_level": -0.1}, "noise_level must be >= 0, got -0.1"),
        ({"noise_level": 0.0}, "noise_level 0 gives sampler 'flow_sde' no noise"),
        ({"num_samples": 0}, "num_samples must be an integer >= 1, got 0"),
        ({"num_inference_steps": 4, "sde_window": (2, 5)}, r"sde_window \(2, 5\) is outside the step range.*\(4\)"),
        ({"num_inference_steps": 4, "sde_window": (-1, 2)}, "sde_window .* outside the step range"),
        ({"num_inference_steps": 4, "sde_window": (3, 3)}, "sde_window .* outside the step range"),
        ({"num_inference_steps": 4, "sampler": "cps", "sde_window": (3, 4)}, "no stochastic step of sampler 'cps'"),
        ({"height": 0}, "height must be a positive integer"),
    ],
)
def test_sampling_params_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_several_problems_are_reported_at_once():
    with pytest.raises(ValueError) as error:
        SamplingParams(num_inference_steps=0, noise_level=-1, num_samples=0)
    assert "num_inference_steps" in str(error.value)
    assert "noise_level" in str(error.value)
    assert "num_samples" in str(error.value)


def test_height_and_width_must_fit_the_model(engine):
    with pytest.raises(ValueError, match=r"height=30 is not divisible by 4 \(VAE scale 2 x patch size 2\)"):
        engine.generate("x", SamplingParams(height=30, width=32))
    with pytest.raises(ValueError, match="width=33"):
        engine.add_request("x", SamplingParams(width=33))
    assert not engine.has_unfinished_requests()


def test_sizes_past_the_positional_embeddings_are_refused_at_admission(engine):
    """SD3's transformer has pos_embed_max_size patches per side (16 on the tiny model): 68 pixels
    failed inside the worker; it is refused before anything is queued, with the most it takes."""
    with pytest.raises(ValueError, match=r"height=68 is above the 64 pixels .*pos_embed_max_size 16 tokens"):
        engine.generate("x", SamplingParams(height=68))
    assert not engine.has_unfinished_requests()
    assert engine.generate("x", SamplingParams(height=64, num_inference_steps=1))[0].status == "finished"


def test_empty_prompt_list(engine):
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate([], SamplingParams())


def test_a_bad_request_in_a_list_starts_nothing(engine):
    # The check runs per prompt before its requests are queued; generate() must not leave the
    # valid ones behind either.
    with pytest.raises(ValueError, match="height=30"):
        engine.generate(["ok", "bad"], [SamplingParams(), SamplingParams(height=30)])
    assert not engine.has_unfinished_requests()
    assert engine.collective_rpc("request_ids") == [[]]


def test_missing_model_folder(tmp_path):
    config = EngineConfig(model=str(tmp_path / "nope"))  # plain data: nothing is read yet
    with pytest.raises(ValueError, match="does not exist; pass a local diffusers pipeline folder"):
        RolloutEngine(config)


def test_folder_that_is_not_a_pipeline(tmp_path):
    with pytest.raises(ValueError, match="is not a diffusers pipeline: it has no model_index.json"):
        RolloutEngine(EngineConfig(model=str(tmp_path)))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(ValueError, match="holds a UNet2DModel, which is not supported"):
        RolloutEngine(EngineConfig(model=str(tmp_path)))


def test_engine_config_errors(tiny_model):
    with pytest.raises(ValueError, match="executor 'uni' runs one in-process worker"):
        RolloutEngine(EngineConfig(model=tiny_model, num_workers=2))
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model=tiny_model, dtype="float8")
    with pytest.raises(ValueError, match="unknown executor 'threads'"):
        RolloutEngine(EngineConfig(model=tiny_model, executor="threads"))


def test_every_problem_is_named_at_once_before_any_worker_starts(tmp_path):
    config = EngineConfig(model=str(tmp_path / "nope"), executor="threads", worker_extension_cls="no.such.Extension")
    with pytest.raises(ValueError) as error:
        RolloutEngine(config)
    message = str(error.value)
    assert message.startswith("invalid EngineConfig: ")
    assert "does not exist" in message and "unknown executor 'threads'" in message and "no.such" in message


def test_unknown_worker_method(engine):
    with pytest.raises(ValueError, match="unknown worker method 'no_such_method'; available: .*'request_ids'"):
        engine.collective_rpc("no_such_method")
    with pytest.raises(ValueError, match="unknown worker method '_private'"):
        engine.collective_rpc("_private")


def test_requests_past_the_engine_s_limits_are_refused_at_admission(tiny_model):
    """Each bound of RequestLimits names itself and its server flag; nothing is queued."""
    from rollout.request_limits import RequestLimits

    limits = RequestLimits(
        max_inference_steps=8,
        max_branch_factor=3,
        max_leaves=4,
        max_pixels=32 * 48,
        max_prompt_bytes=20,
        max_trajectory_bytes=50_000,
    )
    with RolloutEngine(EngineConfig(model=tiny_model, request_limits=limits)) as engine:
        cases = [
            ("x", SamplingParams(num_inference_steps=9), "num_inference_steps=9 is above this engine's limit of 8"),
            ("x", SamplingParams(branch_steps=(1,), branch_factor=4), "--max-branch-factor"),
            ("x", SamplingParams(branch_steps=(1, 2, 3), branch_factor=2), "8 leaves per sample is above"),
            ("x", SamplingParams(height=64, width=64), "height x width = 4096 pixels is above"),
            ("x" * 21, SamplingParams(), "prompt (21 bytes) is above this engine's limit of 20"),
            ("x", SamplingParams(negative_prompt="é" * 11), "negative_prompt (22 bytes)"),
            ("x", SamplingParams(num_inference_steps=8, record=("x0", "mean")), "RequestLimits.max_trajectory_bytes"),
        ]
        for prompt, params, message in cases:
            with pytest.raises(ValueError, match=re.escape(message)):
                engine.generate(prompt, params)
            assert not engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="num_inference_steps must be at most 100000"):
            SamplingParams(num_inference_steps=10**8, branch_steps=(0,))  # refused before its step mask is built
        with pytest.raises(ValueError, match=r"makes more than 2\*\*24 leaves"):
            SamplingParams(branch_steps=(0,), branch_factor=10**30)  # no big-integer arithmetic
        assert engine.generate("x", SamplingParams(num_inference_steps=2, seed=0))[0].status == "finished"
