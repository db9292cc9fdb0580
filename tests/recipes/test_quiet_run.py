"""A training run prints its own progress bar and a few lines, not a line per step: what a step
did goes to the metrics, a repeated adapter load is DEBUG, and no third-party progress bar shows."""

from __future__ import annotations

import collections
import logging

import pytest

from recipes.grpo import run
from recipes.loading import load_config
from tests.recipes.test_checkpoint_resume import SMALL
from tests.recipes.test_training_recipes import CONFIG_DIR
from tests.rollout.pipelines.test_quiet import NOISE

STEPS = 4


@pytest.mark.timeout(120)
def test_a_training_run_logs_no_line_per_step_and_no_third_party_bars(tiny_model, tmp_path, caplog, capfd):
    settings = [f"model.path={tiny_model}", f"output_dir={tmp_path / 'out'}", f"steps={STEPS}", *SMALL]
    with caplog.at_level(logging.INFO):
        run(load_config(CONFIG_DIR / "grpo_tiny.yaml", settings))
    shown = [record for record in caplog.records if record.levelno >= logging.INFO]
    repeated = {message: count for message, count in collections.Counter(r.getMessage() for r in shown).items()}
    assert all(count < STEPS for count in repeated.values()), repeated
    assert len(shown) < 12, [record.getMessage() for record in shown]
    printed = capfd.readouterr()
    noisy = [line for line in (printed.out + printed.err).splitlines() if any(n in line for n in NOISE)]
    assert noisy == [], noisy[:5]
