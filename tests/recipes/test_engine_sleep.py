"""`trainer.engine_sleep`: a colocated rank's engine sleeps through each update and wakes for the
push. The run is the one without it (the same rewards, losses and weights), at level 1 (weights
kept in host memory) and level 2 (dropped, reloaded from the folder; the versions number on)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from recipes.grpo import run
from recipes.loading import load_config
from rollout import RolloutEngine

pytestmark = pytest.mark.timeout(300)

SMALL = ["steps=2", "prompts_per_step=2", "sampling.num_samples=2", "sampling.num_inference_steps=3"]
SMALL += ["eval.num_prompts=1", "eval.num_samples=1", "eval.num_inference_steps=2"]


def _run(tmp_path, tiny_model, name: str, overrides: list[str]) -> tuple[list[dict], dict]:
    out = tmp_path / name
    config = load_config(
        "recipes/configs/grpo_full_tiny.yaml", [f"model.path={tiny_model}", f"output_dir={out}", *SMALL, *overrides]
    )
    run(config)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keep = ("reward_mean", "loss", "weight_version", "log_ratio_before_update")
    weights = load_file(out / "weights" / "transformer" / "diffusion_pytorch_model.safetensors")
    return [{k: r[k] for k in keep if k in r} for r in records], weights


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_engine_trains_the_same_run(tmp_path, tiny_model, monkeypatch, level):
    awake, awake_weights = _run(tmp_path, tiny_model, "awake", [])
    slept = []
    sleep = RolloutEngine.sleep
    monkeypatch.setattr(RolloutEngine, "sleep", lambda engine, lvl=1: (slept.append(lvl), sleep(engine, lvl))[1])
    asleep, asleep_weights = _run(tmp_path, tiny_model, f"sleep{level}", [f"trainer.engine_sleep={level}"])
    assert slept == [level, level]  # once per update
    assert all("reward_mean" in record for record in asleep)
    assert asleep == awake and [r["weight_version"] for r in asleep] == [2, 3]
    assert awake_weights.keys() == asleep_weights.keys()
    assert all(torch.equal(awake_weights[k], asleep_weights[k]) for k in awake_weights)


@pytest.mark.parametrize(
    "config_name, overrides, message",
    [
        ("grpo_tiny.yaml", [], "would free the base weights the LoRA policy shares.*share_base: false"),
        ("grpo_full_tiny.yaml", ["trainer.placement=separate"], "each rank's own engine"),
        (
            "grpo_tiny.yaml",
            ["trainer.share_base=false", "asynchronous.max_staleness=1", "grpo.off_policy_correction=tis"],
            "asynchronous training samples while the trainer updates",
        ),
        ("grpo_full_tiny.yaml", ["trainer.engine_sleep=3"], "engine_sleep must be 0, 1 or 2"),
    ],
)
def test_an_engine_that_cannot_sleep_through_the_updates_is_refused(tmp_path, config_name, overrides, message):
    sleep = [] if any(o.startswith("trainer.engine_sleep") for o in overrides) else ["trainer.engine_sleep=1"]
    with pytest.raises(ValueError, match=message):
        load_config(f"recipes/configs/{config_name}", [f"output_dir={tmp_path}", *sleep, *overrides])
