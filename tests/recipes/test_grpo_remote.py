"""The GRPO recipe against a rollout service (`engine.url`): the reward rises as it does in process,
with the same seed, since the server returns the samples the engine would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recipes.config
from recipes.grpo import run
from recipes.loading import load_config
from rollout.serve.launch import ServerProcess
from tests.recipes.test_grpo_learns import learning_overrides

CONFIG = Path(recipes.config.__file__).parent / "configs" / "grpo_tiny.yaml"
SETTINGS = learning_overrides()


def _rewards(model: str, out: Path, *extra: str) -> list[float]:
    run(load_config(CONFIG, [f"model.path={model}", f"output_dir={out}", *SETTINGS, *extra]))
    return [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_against_a_server_learns_as_in_process(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("ROLLOUT_API_KEY", "recipe-key")
    in_process = _rewards(tiny_model, tmp_path / "local")
    with ServerProcess.start(tiny_model, api_key="recipe-key") as server:
        remote = _rewards(tiny_model, tmp_path / "remote", f"engine.url={server.url}")
    rise = sum(remote[-5:]) / 5 - sum(remote[:5]) / 5
    local_rise = sum(in_process[-5:]) / 5 - sum(in_process[:5]) / 5
    assert rise > 0.03 and abs(rise - local_rise) < 0.25 * local_rise, (remote, in_process)
    # The first rollout precedes any update: the same samples, so the same rewards.
    assert remote[0] == pytest.approx(in_process[0], abs=1e-4)
