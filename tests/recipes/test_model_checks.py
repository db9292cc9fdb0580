"""What the model would refuse is a config problem, reported with the others before anything is
written or loaded: a `model.path` that is no pipeline folder, and a sampling field the model's
family does not take (`true_cfg_scale` on SD3). The family comes from `model.tiny_family`, or from
the folder's model_index.json, without loading it."""

from __future__ import annotations

import dataclasses

import pytest

from recipes.grpo import run
from recipes.loading import load_config
from recipes.run import main
from tests.recipes.test_training_recipes import CONFIG_DIR

GRPO_TINY = CONFIG_DIR / "grpo_tiny.yaml"
NOT_TAKEN = "sampling: true_cfg_scale is not used by StableDiffusion3Pipeline; leave it unset"


@pytest.mark.timeout(30)
def test_a_field_the_family_does_not_take_is_reported_with_the_other_problems(tiny_model):
    for model in ("model.path=tiny", f"model.path={tiny_model}"):  # by tiny_family, and by the folder
        with pytest.raises(ValueError) as error:
            load_config(GRPO_TINY, [model, "sampling.true_cfg_scale=4.0", "steps=0"])
        assert NOT_TAKEN in str(error.value) and "steps must be >= 1" in str(error.value)
    with pytest.raises(ValueError, match="guidance_scale_2 is not used by WanPipeline"):
        load_config(GRPO_TINY, ["model.tiny_family=wan", "sampling.guidance_scale_2=3.0"])
    load_config(GRPO_TINY, ["model.tiny_family=wan22", "sampling.guidance_scale_2=3.0"])  # its second expert's
    with pytest.raises(ValueError, match="num_frames is for video pipelines; StableDiffusion3Pipeline makes images"):
        load_config(GRPO_TINY, ["sampling.num_frames=9"])


@pytest.mark.timeout(30)
def test_the_cli_reports_a_missing_model_folder_with_the_other_problems(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(GRPO_TINY), "--set", f"model.path={tmp_path / 'nowhere'}", "--set", "steps=0"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "(2 problems)" in error and "steps must be >= 1" in error
    assert f"model.path: model folder '{tmp_path / 'nowhere'}' does not exist" in error


@pytest.mark.timeout(30)
def test_a_run_the_model_would_refuse_stops_before_it_writes_or_loads(tmp_path):
    out = tmp_path / "out"
    config = load_config(GRPO_TINY, [f"output_dir={out}", f"model.path={tmp_path / 'nowhere'}"])  # checked elsewhere
    with pytest.raises(ValueError, match="model.path: model folder .* does not exist"):
        run(config)
    refused = dataclasses.replace(config, model=dataclasses.replace(config.model, path="tiny"))
    refused.sampling = dataclasses.replace(config.sampling, true_cfg_scale=4.0)  # past load_config's check
    with pytest.raises(ValueError, match=NOT_TAKEN):
        run(refused)
    assert not out.exists()  # no empty metrics.jsonl
