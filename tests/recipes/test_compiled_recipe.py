"""A GRPO recipe with `engine: compile: blocks`: the engine samples with compiled blocks, the
trainer's policy compiles the same way (`LoraPolicy(compile=)`), its first update re-scores the
compiled rollout within the contract, and the run learns what the eager run learns, to float32
rounding."""

from __future__ import annotations

import pytest

from recipes.grpo import run
from recipes.loading import load_config
from rollout.rescoring import RATIO_TOLERANCE
from tests.recipes.test_checkpoint_resume import CONFIG, assert_same_lora, metrics, settings

pytestmark = pytest.mark.timeout(400)


@pytest.mark.slow
def test_a_compiled_grpo_run_rescores_within_the_contract_and_trains_as_the_eager_one(tiny_model, tmp_path):
    def train(out, *extra):
        return run(load_config(CONFIG, settings(tiny_model, out, "steps=3", *extra)))

    eager = train(tmp_path / "eager")
    compiled = train(tmp_path / "compiled", "engine.compile=blocks")
    assert compiled["log_ratio_before_first_update"] < RATIO_TOLERANCE
    records, expected = metrics(tmp_path / "compiled"), metrics(tmp_path / "eager")
    assert [r["log_ratio_before_update"] for r in records] == pytest.approx(
        [r["log_ratio_before_update"] for r in expected], abs=RATIO_TOLERANCE
    )
    for key in ("reward_mean", "loss"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in expected], rel=1e-3, abs=1e-5)
    assert compiled["eval_reward_end"] == pytest.approx(eager["eval_reward_end"], rel=1e-3, abs=1e-5)
    # Adam moves an element by up to the learning rate (0.01) a step whatever its gradient's size, so
    # compiled kernels' float32 rounding in a near-zero gradient shows at a hundredth of a step: 3.1e-5
    # measured after 3 steps at the tiny model's 32 x 32.
    assert_same_lora(tmp_path / "compiled" / "lora", tmp_path / "eager" / "lora", rtol=1e-3, atol=1e-4)
