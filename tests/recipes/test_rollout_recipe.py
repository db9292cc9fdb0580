"""The rollout recipe end to end, through the real `python -m recipes.run` entry point."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest
from PIL import Image

import recipes.config
from recipes.rollout import GRID_GAP_PX

CONFIG = Path(recipes.config.__file__).parent / "configs" / "rollout_tiny.yaml"


@pytest.mark.timeout(240)
# runpy warns that recipes.run is already imported when another test imported it first.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("executor", ["uni", pytest.param("mp", marks=pytest.mark.slow)])
def test_rollout_recipe_writes_grid_and_summary(tmp_path, monkeypatch, executor):
    output_dir = tmp_path / "out"
    cache_dir = tmp_path / "tiny_sd3"
    argv = [
        "recipes/run.py",
        str(CONFIG),
        "--set",
        "prompts=[a red square, a blue circle]",
        "--set",
        "sampling.num_samples=2",
        "--set",
        "sampling.num_inference_steps=3",
        "--set",
        f"output_dir={output_dir}",
        "--set",
        f"model.tiny_cache_dir={cache_dir}",
        "--set",
        f"engine.executor={executor}",
        "--set",
        f"engine.num_workers={2 if executor == 'mp' else 1}",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_module("recipes.run", run_name="__main__")

    assert (cache_dir / "model_index.json").is_file()
    with Image.open(output_dir / "grid.png") as grid:
        cell = 32 * 4  # tiny images are 32x32, upscaled 4x by the shipped config
        assert grid.size == (2 * cell + GRID_GAP_PX, 2 * cell + GRID_GAP_PX)

    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["num_samples"] == 4 and summary["num_prompts"] == 2
    assert summary["config"]["sampling"]["num_inference_steps"] == 3
    assert summary["wall_time_s"] > 0 and summary["images_per_s"] > 0
    samples = summary["samples"]
    assert [(s["prompt"], s["sample_index"]) for s in samples] == [
        ("a red square", 0),
        ("a red square", 1),
        ("a blue circle", 0),
        ("a blue circle", 1),
    ]
    for sample in samples:
        assert sample["sde_mask"] == [True, True, True]  # flow_sde: every step is stochastic
        assert len(sample["log_probs"]) == 3
        assert all(math.isfinite(lp) for lp in sample["log_probs"])
        assert math.isclose(sample["log_prob_sum"], sum(sample["log_probs"]), rel_tol=1e-5, abs_tol=1e-5)
        assert sample["latent_shape"] == [4, 4, 16, 16]
        assert math.isfinite(sample["final_latent_mean"]) and sample["final_latent_std"] > 0
        assert sample["timings"]["total_s"] > 0
    assert len({s["request_id"] for s in samples}) == 4


def test_grid_has_a_column_per_leaf_of_a_tree_rollout():
    import torch

    from recipes.rollout import image_grid
    from rollout import NodeId, RolloutOutput

    outputs = [
        RolloutOutput(
            node_id=NodeId(f"r{p}", k, (c,)),
            prompt="x",
            prompt_index=p,
            seed=0,
            image=torch.full((3, 2, 2), 10 * (4 * p + 2 * k + c), dtype=torch.uint8),
        )
        for p in range(2)
        for k in range(2)
        for c in range(2)
    ]
    grid = image_grid(outputs, scale=1)
    assert grid.size == (4 * 2 + 3 * GRID_GAP_PX, 2 * 2 + GRID_GAP_PX)
    step = 2 + GRID_GAP_PX
    assert [grid.getpixel((column * step, step))[0] for column in range(4)] == [40, 50, 60, 70]
