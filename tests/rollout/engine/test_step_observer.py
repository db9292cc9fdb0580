"""The engine's step observer: what benchmarks read instead of patching the engine."""

from __future__ import annotations

import pytest

from rollout import SamplingParams
from rollout.engine.step_report import StepReport

pytestmark = pytest.mark.timeout(120)


def test_steps_report_rows_times_and_finished_outputs(engine):
    reports: list[StepReport] = []
    remove = engine.add_step_observer(reports.append)
    try:
        # SD3 runs the CFG halves in one pass: 2 prompts x 2 samples, each step 4 rows + 4 unconditional.
        params = SamplingParams(num_inference_steps=3, num_samples=2, guidance_scale=4.5, seed=0)
        outputs = engine.generate(["a red square", "a blue circle"], params)
    finally:
        remove()
    steps = [r for r in reports if r.kind == "step"]
    assert len(steps) == 3
    assert [r.transformer_rows for r in steps] == [(8,)] * 3
    assert sum(r.finished for r in steps) == len(outputs) == 4
    for report in steps:
        assert 0 < report.transformer_s[0] <= report.compute_s[0] <= report.execute_s <= report.wall_s
    seen = len(reports)
    engine.generate(["a red square"], params)
    assert len(reports) == seen, "a removed observer is called no more"


def test_worker_functions_are_reported_by_name(engine):
    reports: list[StepReport] = []
    remove = engine.add_step_observer(reports.append)
    try:
        engine.collective_rpc("get_rank")
    finally:
        remove()
    assert [(r.kind, r.name) for r in reports] == [("rpc", "get_rank")]
    assert reports[0].wall_s > 0 and reports[0].compute_s == ()


def test_an_observer_that_raises_is_removed_and_no_output_is_lost(engine, caplog):
    calls = []

    def broken(report: StepReport) -> None:
        calls.append(report)
        raise RuntimeError("observer bug")

    engine.add_step_observer(broken)
    outputs = engine.generate(["a red square"], SamplingParams(num_inference_steps=2, num_samples=2, seed=0))
    assert len(outputs) == 2 and all(o.status == "finished" for o in outputs)
    assert len(calls) == 1
    assert "observer bug" in caplog.text
