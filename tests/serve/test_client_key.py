"""A client without an API key meets a server that requires one: it says so as it is made, naming
where the key goes, before it sends any call; a recipe with `engine.url` says so as a config error
before it loads its model or writes anything."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import recipes.config
from recipes.grpo import run
from recipes.loading import load_config
from rollout import RemoteRolloutEngine
from rollout.serve import API_KEY_ENV

NO_KEY = rf"requires an API key, and this client has none: export {API_KEY_ENV}=<key>, or pass .*api_key="


@pytest.mark.timeout(60)
def test_a_client_without_a_key_refuses_a_keyed_server_before_any_call(server, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(PermissionError, match=NO_KEY):
        RemoteRolloutEngine(server.url)


@pytest.mark.timeout(120)
def test_a_recipe_without_a_key_stops_before_it_loads_its_model(server, tiny_model, tmp_path, monkeypatch):
    # A folder the config check takes but whose transformer cannot load: a recipe that loaded its
    # policy before it asked the server would fail on the weights instead.
    unloadable = Path(shutil.copytree(tiny_model, tmp_path / "pipeline"))
    for weights in (unloadable / "transformer").glob("*.safetensors"):
        weights.unlink()
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config_path = Path(recipes.config.__file__).parent / "configs" / "grpo_tiny.yaml"
    settings = [f"model.path={unloadable}", f"output_dir={tmp_path / 'out'}", f"engine.url={server.url}"]
    with pytest.raises(ValueError, match=f"invalid config: engine.url: .*{NO_KEY}"):  # a config error, as a bad URL's
        run(load_config(config_path, settings))
    assert not (tmp_path / "out").exists()  # nothing written
