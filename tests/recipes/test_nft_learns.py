"""DiffusionNFT on the tiny SD3 raises the reward on every one of three seeds, each margin well
clear of its own noise (`reward_margin`, as for GRPO), while the engine samples the old adapter
(nft_step refuses any other rollout) and that adapter follows the policy with the EMA decay the
schedule gives at each optimizer step. Measured (2 loaded CPU cores, about 2 minutes a seed):
margins +0.102, +0.174, +0.157 on seeds 0-2, each over 40 standard errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recipes.config
from recipes.loading import load_config
from recipes.nft import run
from tests.recipes.test_grpo_learns import reward_margin

CONFIG = Path(recipes.config.__file__).parent / "configs" / "nft_tiny.yaml"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nft_raises_the_reward_on_every_seed(tmp_path, tiny_model):
    margins = []
    for seed in (0, 1, 2):
        out = tmp_path / f"seed{seed}"
        config = load_config(
            CONFIG,
            [
                f"model.path={tiny_model}",
                f"output_dir={out}",
                f"seed={seed}",
                "steps=15",
                "prompts_per_step=2",
                "sampling.num_inference_steps=6",
                "eval.num_prompts=1",
                "eval.num_samples=1",
                "eval.num_inference_steps=2",
            ],
        )
        summary = run(config)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        schedule = config.nft.decay_schedule()
        assert [r["old_optimizer_steps"] for r in records] == list(range(1, 16))
        assert [r["old_decay"] for r in records] == [schedule(step) for step in range(1, 16)]
        assert records[0]["old_deviation"] == 0.0  # the old adapter starts as a copy of the policy's
        assert all(r["old_deviation"] > 0 for r in records[1:])
        assert summary["final_weight_version"] == 2 * 16  # both adapters pushed at the start and after each step
        margin, std_error = reward_margin(out / "metrics.jsonl")
        assert margin > 5 * std_error, f"seed {seed}: margin {margin:.4f}, std error {std_error:.4f}"
        margins.append(margin)
    assert min(margins) > 0.05, margins
