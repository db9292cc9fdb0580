"""Recipe configs: every shipped YAML validates, problems are reported together, `--set` overrides work."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
from pathlib import Path

import pytest
import yaml

import recipes.config
from recipes.config import EngineSection, ModelSection, config_keys
from recipes.loading import load_config, recipe_module
from recipes.run import main
from rollout import EngineConfig, SamplingParams
from rollout.pipelines.tiny.saving import BUILD_STAMP, builder_digest, is_current_build
from rollout.settings import setting_default, setting_help

CONFIG_DIR = Path(recipes.config.__file__).parent / "configs"
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))

MINIMAL = "recipe: rollout\nprompts: [a red square]\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def problems_of(error: pytest.ExceptionInfo) -> list[str]:
    return [line[4:] for line in str(error.value).splitlines()[1:]]


def test_configs_are_shipped():
    assert SHIPPED, f"no YAML configs found in {CONFIG_DIR}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    config = load_config(path)
    assert isinstance(config, recipe_module(config.recipe).Config)
    assert path.read_text().lstrip().startswith("#"), "a shipped config starts with a header comment"
    # its launch line: python -m recipes.run ..., or torchrun ... -m recipes.run ... for several ranks
    assert f" -m recipes.run recipes/configs/{path.name}" in path.read_text()


def test_every_shipped_config_is_in_the_training_docs_recipe_list():
    listed = (CONFIG_DIR.parents[1] / "docs" / "training.md").read_text()
    missing = [path.name for path in SHIPPED if f" -m recipes.run recipes/configs/{path.name}" not in listed]
    assert missing == [], f"docs/training.md's recipe list lacks {missing}"


@pytest.mark.timeout(30)
def test_rollout_tiny_values():
    config = load_config(CONFIG_DIR / "rollout_tiny.yaml")
    assert config.model.path == "tiny"
    assert config.engine.executor == "uni"
    assert config.prompts == ["a red square", "a green circle", "a blue triangle", "a yellow star"]
    assert config.sampling == SamplingParams(
        num_samples=4,
        num_inference_steps=10,
        sampler="flow_sde",
        noise_level=0.7,
        log_prob_form="flow_grpo",
        guidance_scale=4.5,
        seed=0,
        same_noise_in_group=True,
    )
    assert config.output_dir == "outputs/rollout_tiny"


@pytest.mark.timeout(60)
def test_a_worker_extension_is_a_config_key_checked_with_the_executor(tiny_model):
    """`engine.worker_extension_cls` (a dotted path) reaches the engine, whose workers then answer its
    functions by name; one that does not import is a problem of the config's one error."""
    extension = "tests.serve.worker_extension.ServeTestExtension"
    config = load_config(CONFIG_DIR / "rollout_tiny.yaml", [f"engine.worker_extension_cls={extension}"])
    assert config.engine.worker_extension_cls == extension
    with config.engine.open_engine(tiny_model) as engine:
        assert engine.config.worker_extension_cls == extension
        assert engine.collective_rpc("pid") == [os.getpid()]  # a method of the extension, by name
    with pytest.raises(ValueError) as error:
        load_config(CONFIG_DIR / "rollout_tiny.yaml", ["engine.worker_extension_cls=my_pkg.missing.Functions"])
    (problem,) = problems_of(error)
    assert problem.startswith("engine: ") and "my_pkg.missing.Functions" in problem


@pytest.mark.timeout(30)
def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    with pytest.raises(ValueError) as error:
        load_config(write(tmp_path, MINIMAL + "sampling:\n  num_step: 4\n"))
    assert problems_of(error) == ["unknown key 'sampling.num_step'; did you mean 'sampling.num_samples'?"]


@pytest.mark.timeout(30)
def test_wrong_type_names_key_expected_type_and_value(tmp_path):
    with pytest.raises(ValueError) as error:
        load_config(write(tmp_path, MINIMAL + "engine:\n  num_workers: two\n"))
    assert problems_of(error) == ["engine.num_workers: expected int, got 'two' (str)"]


@pytest.mark.timeout(30)
def test_every_problem_is_reported_at_once(tmp_path):
    text = (
        "recipe: rollout\n"
        "colour: red\n"  # unknown top-level key
        "model:\n  path: 3\n"  # wrong type
        "engine:\n  max_batch_size: true\n  devices: cpu\n"  # a bool is not an int; unknown key
        "sampling:\n  sde_window: [0, one]\n"  # wrong element type
        "grid_scale: 2.5\n"  # float for int
    )  # and `prompts` is missing
    with pytest.raises(ValueError) as error:
        load_config(write(tmp_path, text), ["sampling.seed"])  # and a malformed override
    problems = problems_of(error)
    assert str(error.value).startswith(f"invalid config {tmp_path / 'config.yaml'} (8 problems):")
    assert sorted(problems) == sorted(
        [
            "--set 'sampling.seed': expected KEY=VALUE, e.g. sampling.num_inference_steps=4",
            "unknown key 'colour'; valid keys here: recipe, model, engine, sampling, prompts, output_dir, grid_scale",
            "model.path: expected str, got 3 (int)",
            "unknown key 'engine.devices'; did you mean 'engine.device'?",
            "engine.max_batch_size: expected int, got True (bool)",
            "sampling.sde_window: expected a list [int, int] or null, got [0, 'one'] (list)",
            "prompts: missing; prompts to sample; each one is a row of grid.png",
            "grid_scale: expected int, got 2.5 (float)",
        ]
    )


@pytest.mark.timeout(30)
def test_value_checks_of_the_dataclasses_are_reported(tmp_path):
    text = MINIMAL + "sampling:\n  sampler: euler\n  num_samples: 0\n"
    with pytest.raises(ValueError) as error:
        load_config(write(tmp_path, text))
    (problem,) = problems_of(error)
    assert problem.startswith("sampling: invalid SamplingParams: sampler must be one of")
    assert "num_samples must be an integer >= 1, got 0" in problem

    with pytest.raises(ValueError) as error:
        load_config(write(tmp_path, "recipe: rollout\nprompts: []\ngrid_scale: 0\n"))
    assert problems_of(error) == [
        "config: prompts is empty; give at least one prompt",
        "config: grid_scale must be an integer >= 1, got 0",
    ]


@pytest.mark.timeout(30)
def test_unknown_recipe_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"recipe: must be one of \['dpo', 'grpo', 'nft', 'rollout'\], got 'ppo'"):
        load_config(write(tmp_path, "recipe: ppo\n"))


@pytest.mark.timeout(30)
def test_set_overrides_parse_values_as_yaml(tmp_path):
    config = load_config(
        CONFIG_DIR / "rollout_tiny.yaml",
        [
            "sampling.num_inference_steps=4",
            "sampling.noise_level=0.5",
            "sampling.guidance_scale=1",  # an int where a float is expected
            "sampling.seed=null",
            "sampling.sde_window=[0, 2]",
            "prompts=[a cat, a dog]",
            "output_dir=/tmp/x=y",  # only the first '=' separates key and value
            "engine.max_batch_size=8",
        ],
    )
    sampling = config.sampling
    assert sampling.num_inference_steps == 4 and isinstance(sampling.num_inference_steps, int)
    assert sampling.noise_level == 0.5
    assert sampling.guidance_scale == 1.0 and isinstance(sampling.guidance_scale, float)
    assert sampling.seed is None
    assert sampling.sde_window == (0, 2)
    assert config.prompts == ["a cat", "a dog"]
    assert config.output_dir == "/tmp/x=y"
    assert config.engine.max_batch_size == 8


@pytest.mark.timeout(30)
def test_set_overrides_are_checked_like_the_file(tmp_path):
    overrides = ["sampling.num_step=4", "sampling.seed=zero", "prompts.first=a cat", "sampling.seed=[0"]
    with pytest.raises(ValueError) as error:
        load_config(write(tmp_path, MINIMAL), overrides)
    problems = problems_of(error)
    assert "unknown key 'sampling.num_step'; did you mean 'sampling.num_samples'?" in problems
    assert "sampling.seed: expected int or null, got 'zero' (str)" in problems
    assert "--set 'prompts.first=a cat': 'prompts' is a value, not a section" in problems
    assert any(p.startswith("--set 'sampling.seed=[0': the value is not valid YAML") for p in problems)


@pytest.mark.timeout(30)
def test_help_lists_every_key_with_its_description(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--set KEY=VALUE" in text
    for recipe in ("rollout", "grpo", "dpo"):
        keys = list(config_keys(recipe_module(recipe).Config))
        assert "(no description)" not in {help_text for _, _, help_text in keys}, recipe
        for key, default, help_text in keys:
            assert f"{key} = {default}" in text and help_text in text
        assert {key for key, _, _ in keys} >= {f"sampling.{name}" for name in SamplingParams.__dataclass_fields__}
    assert "grpo.clip_range = 0.0001" in text and "dpo.beta = 2000.0" in text


@pytest.mark.timeout(30)
def test_cli_reports_config_problems_and_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(write(tmp_path, MINIMAL)), "--set", "sampling.num_inference_steps=ten"])
    assert exit_info.value.code == 2
    assert "sampling.num_inference_steps: expected int, got 'ten' (str)" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_tiny_model_cache_is_reused_and_never_clobbered(tmp_path):
    assert ModelSection(path="some/pipeline").resolve_path() == "some/pipeline"
    cache = tmp_path / "tiny"
    cache.mkdir()
    (cache / "model_index.json").write_text("{}")
    (cache / BUILD_STAMP).write_text(json.dumps({"builder": builder_digest()}))
    assert ModelSection(tiny_cache_dir=str(cache)).resolve_path() == str(cache)  # reused: no build
    assert (cache / "model_index.json").read_text() == "{}"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty but holds no model_index.json"):
        ModelSection(tiny_cache_dir=str(other)).resolve_path()
    assert (other / "notes.txt").read_text() == "mine"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stamp", [None, {"builder": "an older builder's digest"}], ids=["unstamped", "older"])
def test_a_tiny_model_cache_from_other_builders_is_rebuilt(tmp_path, stamp):
    """A cache that today's tiny builders did not make (made before they stamped their folders, or
    by a version whose sizes have changed since) is rebuilt in its place, not loaded."""
    cache = tmp_path / "tiny"
    cache.mkdir()
    (cache / "model_index.json").write_text("{}")
    (cache / "left_by_the_old_build.txt").write_text("stale")
    if stamp is not None:
        (cache / BUILD_STAMP).write_text(json.dumps(stamp))
    assert ModelSection(tiny_cache_dir=str(cache)).resolve_path() == str(cache)
    assert json.loads((cache / "model_index.json").read_text())["_class_name"] == "StableDiffusion3Pipeline"
    assert is_current_build(cache) and not (cache / "left_by_the_old_build.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no staging folder left beside it


@pytest.mark.timeout(30)
def test_a_tiny_model_cache_saved_under_another_diffusers_is_stale(monkeypatch):
    """The stamp covers the library versions the builders use, not only their source: an upgraded
    diffusers saves other config fields, so a folder the old one saved is rebuilt."""
    today = builder_digest()
    installed = importlib.metadata.version

    def upgraded(library: str) -> str:
        return "99.0.0" if library == "diffusers" else installed(library)

    monkeypatch.setattr(importlib.metadata, "version", upgraded)
    assert builder_digest() != today


def test_the_engine_section_shows_engine_config_s_own_defaults_and_help():
    engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(EngineSection):
        if f.name == "url":  # the section's own: a rollout service instead of an engine here
            continue
        assert f.name in engine_fields, f"engine.{f.name} is no EngineConfig field"
        assert setting_default(f) == setting_default(engine_fields[f.name])
        assert setting_help(EngineSection, f.name) == setting_help(EngineConfig, f.name)


@pytest.mark.timeout(30)
def test_a_float_key_takes_a_number_written_as_text(tmp_path):
    """YAML 1.1 (PyYAML) reads 1e-5, with no dot, as the string '1e-5'."""
    text = MINIMAL + "sampling:\n  noise_level: 5e-1\n  guidance_scale: '2'\n"
    overrides = ["sampling.lora_scale=1E0", "sampling.guidance_scale_2=3", "model.tiny_family=wan22"]  # it takes _2
    config = load_config(write(tmp_path, text), overrides)
    assert config.sampling.noise_level == 0.5 and isinstance(config.sampling.noise_level, float)
    assert config.sampling.guidance_scale == 2.0 and isinstance(config.sampling.guidance_scale, float)
    assert config.sampling.lora_scale == 1.0 and config.sampling.guidance_scale_2 == 3.0
    with pytest.raises(ValueError) as error:
        load_config(write(tmp_path, MINIMAL), ["sampling.noise_level=high", "sampling.lora_scale=1e-5x"])
    assert sorted(problems_of(error)) == [
        "sampling.lora_scale: expected float, got '1e-5x' (str)",
        "sampling.noise_level: expected float, got 'high' (str)",
    ]
    with pytest.raises(ValueError) as error:  # an int key stays an int: "4" is text, 4.0 is a float
        load_config(write(tmp_path, MINIMAL + "grid_scale: '4'\n"))
    assert problems_of(error) == ["grid_scale: expected int, got '4' (str)"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["rollout_tiny.yaml", "grpo_tiny.yaml"])
def test_an_engine_url_where_nothing_answers_is_one_config_error_and_writes_nothing(capsys, tmp_path, name):
    """The CLI answers with the config check's one line (no chained traceback), and the recipe run
    directly refuses the same way; neither creates output_dir."""
    from rollout.serve.launch import free_port

    url, out = f"http://127.0.0.1:{free_port()}", tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main([str(CONFIG_DIR / name), "--set", f"engine.url={url}", "--set", f"output_dir={out}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"(1 problem):\n  - engine.url: no rollout service answers at {url} (ConnectError: " in err
    assert "Traceback" not in err and not out.exists()
    config = load_config(CONFIG_DIR / name, [f"engine.url={url}", f"output_dir={out}"])
    with pytest.raises(ValueError, match=f"invalid config: engine.url: no rollout service answers at {url}"):
        recipe_module(config.recipe).run(config)
    assert not out.exists()


@pytest.mark.timeout(30)
def test_cli_takes_a_float_without_a_dot_and_refuses_text(capsys):
    grpo_tiny = str(CONFIG_DIR / "grpo_tiny.yaml")
    assert load_config(grpo_tiny, ["grpo.clip_range=1e-5"]).grpo.clip_range == 1e-5
    with pytest.raises(SystemExit) as exit_info:  # steps=0 stops it before it trains: only steps is wrong
        main([grpo_tiny, "--set", "grpo.clip_range=1e-5", "--set", "steps=0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "(1 problem)" in err and "steps must be >= 1, got 0" in err and "clip_range" not in err
    with pytest.raises(SystemExit) as exit_info:
        main([grpo_tiny, "--set", "grpo.clip_range=tiny"])
    assert exit_info.value.code == 2
    assert "grpo.clip_range: expected float, got 'tiny' (str)" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_a_section_given_twice_is_refused_not_half_read(tmp_path):
    """YAML keeps the last of two equal keys; a config with two `trainer:` sections would silently
    lose the first one's settings."""
    path = tmp_path / "twice.yaml"
    path.write_text("recipe: grpo\ntrainer:\n  placement: separate\ntrainer:\n  share_base: false\n")
    with pytest.raises(yaml.YAMLError, match=r"key 'trainer' appears twice") as refused:
        load_config(path)
    assert "twice.yaml" in str(refused.value) and "line 4" in str(refused.value)
