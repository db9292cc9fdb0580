"""benchmarks/train_scaling: its cases parse and launch as users launch the recipe, a run's split
accounts for every second of a step after the first, and end to end (slow) 1 and 2 trainer ranks
against one `mp` engine train the same, with the speedups of 2 ranks over 1."""

from __future__ import annotations

import json

import pytest

from benchmarks import train_scaling
from benchmarks.train_scaling import Case

pytestmark = pytest.mark.timeout(600)


def test_cases_parse_and_launch_one_rank_plainly_and_two_under_torchrun():
    assert Case.parse("separate-2x1") == Case("separate", 2, 1)
    assert [case.name for case in train_scaling.default_cases(2)] == [
        "colocated-1x2",
        "colocated-1x1",
        "colocated-2x1",
        "separate-1x2",
        "separate-1x1",
        "separate-2x1",
    ]
    assert len(train_scaling.default_cases(1)) == 4  # 1x1 once per placement
    for bad in ("colocated-3x1", "hybrid-2x1", "colocated-2"):
        with pytest.raises(ValueError, match="PLACEMENT-RANKSxTHREADS"):
            Case.parse(bad)
    one = train_scaling.command(Case("colocated", 1, 2), ["steps=3"])
    two = train_scaling.command(Case("colocated", 2, 1), ["steps=3"])
    assert "torch.distributed.run" not in one and one[-2:] == ["--set", "steps=3"]
    assert two[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert two[5:7] == ["-m", "recipes.run"]


def test_the_split_skips_the_first_step_and_its_parts_add_up_to_each_step():
    # Three steps as training.py logs them: wall_s at each step's end, counted from before the first eval.
    keys = ("wall_s", "rollout_s", "reward_wait_s", "trainer_wait_s", "update_s", "push_s")
    history = [
        dict(zip(keys, (5.0, 2.0, 0.5, 2.5, 2.0, 0.1), strict=True)),
        dict(zip(keys, (8.0, 1.0, 0.25, 1.5, 1.0, 0.1), strict=True)),
        dict(zip(keys, (11.0, 1.0, 0.25, 1.5, 1.0, 0.1), strict=True)),
    ]
    split = train_scaling.step_split(history)
    assert split["step_s"] == pytest.approx(3.0)
    assert split["sampling_s"] == pytest.approx(0.75) and split["share_s"] == pytest.approx(0.5)
    parts = sum(split[part] for part in train_scaling.PARTS)
    assert parts == pytest.approx(split["step_s"])  # equal steps: the medians add up too
    with pytest.raises(ValueError, match="at least 3"):
        train_scaling.step_split(history[:2])


@pytest.mark.slow
def test_one_and_two_ranks_against_one_mp_engine_train_the_same(tmp_path, tiny_model):
    path = tmp_path / "train_scaling.json"
    argv = ["--model", tiny_model, "--cases", "colocated-1x1", "separate-1x2", "separate-2x1", "--steps", "3"]
    argv += ["--prompts-per-step", "3", "--num-samples", "2", "--set", "sampling.num_inference_steps=2"]
    report = train_scaling.main([*argv, "--json", str(path)])
    assert json.loads(path.read_text())["results"] == report["results"]
    cases = report["results"]["cases"]
    assert list(cases) == ["colocated-1x1", "separate-1x2", "separate-2x1"]
    for measured in cases.values():
        assert all(value[0] > 0 for key, value in measured.items() if key in ("step_s", "sampling_s", "update_s"))
    assert set(report["results"]["speedups"]) == {"separate-2x1 over separate-1x2"}
    assert [len(runs[0]) for runs in report["results"]["reward_mean"].values()] == [3, 3, 3]
    assert all(target["met"] for target in report["targets"])  # the three runs learn the same
