"""A recipe's config check answers at once: `python -m recipes.run` reports a config problem (a typo,
a field the model's family does not take, a model folder that does not exist) and prints `--help`
without importing torch, diffusers or fastapi (they took ~5 s before the check could answer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "diffusers", "fastapi", "transformers", "peft", "numpy")

# Runs the entry point as `python -m recipes.run ARGS` does, then reports its exit code and which of
# the heavy modules it imported (on stdout's last line; the recipe's own output comes before it).
RUN_AND_REPORT = """
import json, runpy, sys
heavy = json.loads(sys.argv[2])
sys.argv = ["recipes.run", *json.loads(sys.argv[1])]
try:
    runpy.run_module("recipes.run", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}))
"""


def run_recipe(*args: str) -> tuple[dict, str, str]:
    """(exit code and heavy modules imported, stdout before the report, stderr) of `recipes.run ARGS`."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", RUN_AND_REPORT, json.dumps(args), json.dumps(HEAVY)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    *output, report = done.stdout.splitlines()
    return json.loads(report), "\n".join(output), done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("config", "override", "problem"),
    [
        (
            "grpo_tiny.yaml",
            "sampling.tru_cfg=1",
            "unknown key 'sampling.tru_cfg'; did you mean 'sampling.true_cfg_scale'?",
        ),
        (
            "grpo_tiny.yaml",
            "sampling.true_cfg_scale=4.0",
            "sampling: true_cfg_scale is not used by StableDiffusion3Pipeline",
        ),
        (
            "grpo_tiny.yaml",
            "model.path=/nonexistent/sd3",
            "model.path: model folder '/nonexistent/sd3' does not exist",
        ),
        ("rollout_tiny.yaml", "sampling.tru_cfg=1", "unknown key 'sampling.tru_cfg'"),
        ("dpo_tiny.yaml", "dpo.bta=1", "unknown key 'dpo.bta'"),
        ("nft_tiny.yaml", "nft.bta=1", "unknown key 'nft.bta'"),
    ],
    ids=["typo", "family_field", "model_path", "rollout", "dpo", "nft"],
)
def test_a_config_problem_is_reported_without_torch(config, override, problem):
    report, _, stderr = run_recipe(f"recipes/configs/{config}", "--set", override)
    assert report["code"] == 2, stderr
    assert "invalid config" in stderr and problem in stderr
    assert report["imported"] == [], f"the config check imported {report['imported']}"


@pytest.mark.timeout(120)
def test_help_lists_every_recipes_keys_without_torch():
    report, output, stderr = run_recipe("--help")
    assert report["code"] == 0, stderr
    for key in ("grpo.clip_range", "dpo.beta", "nft.beta", "sampling.true_cfg_scale", "engine.executor"):
        assert key in output
    assert report["imported"] == [], f"--help imported {report['imported']}"
