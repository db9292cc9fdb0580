"""grpo_qwen_image_edit_tiny.yaml runs end to end: every prompt edits its own generated image, the
reward reads both images, and the first update starts at ratio 1 (the trainer re-scores with the
trajectories' prompt and image encodings). A short run, not a learning check: each step encodes
its megapixel reference images (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recipes.config
from recipes.grpo import run
from recipes.loading import load_config
from rollout.rescoring import RATIO_TOLERANCE

CONFIG_DIR = Path(recipes.config.__file__).parent / "configs"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen_image_edit"])
def test_the_qwen_image_edit_recipe_runs_and_starts_at_ratio_one(tmp_path, tiny_models, family):
    out = tmp_path / "edit"
    config = load_config(
        CONFIG_DIR / "grpo_qwen_image_edit_tiny.yaml",
        [
            f"model.path={tiny_models(family)}",
            f"output_dir={out}",
            "steps=2",
            "prompts_per_step=2",
            "sampling.num_samples=4",
            "sampling.num_inference_steps=4",
            "eval.num_prompts=1",
            "eval.num_samples=1",
            "eval.num_inference_steps=2",
        ],
    )
    summary = run(config)
    assert summary["log_ratio_before_first_update"] < RATIO_TOLERANCE
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "reward_mean" in m]) == 2
    assert (out / "lora").is_dir()
