"""`python -m benchmarks.parallel`: the cost model at real size runs end to end on the meta device,
its counts agree with the published sizes and the analytic attention, and it picks what its
assumptions imply."""

from __future__ import annotations

import json

import pytest

from benchmarks import parallel


@pytest.mark.slow  # builds three 12B-20B transformers on meta and counts four forwards: ~30 s of CPU
@pytest.mark.timeout(600)
def test_cost_mode_picks_cfg_parallel_where_there_are_two_passes(tmp_path):
    report = parallel.main(["--json", str(tmp_path / "parallel.json")])
    assert all(target["met"] for target in report["targets"]), report["targets"]
    results = report["results"]
    # One GPU holds each sample; CFG parallel costs one velocity exchange a step, nothing else is free.
    assert results["Wan 2.1 T2V 14B"]["picked"] == "d4 c2 u1 r1"
    assert results["Qwen-Image"]["picked"] == "d4 c2 u1 r1"
    assert results["FLUX.1-dev"]["picked"] == "d8 c1 u1 r1"  # distilled guidance: one pass, nothing to split
    assert len(results["Wan 2.1 T2V 14B"]["layouts"]) == 16 and len(results["FLUX.1-dev"]["layouts"]) == 10
    vllm = results["vllm_omni_qwen_image_2048"]
    assert 0 < vllm["mfu_fit_1_pass"] < vllm["mfu_fit_cfg"] < 1
    assert json.loads((tmp_path / "parallel.json").read_text())["header"]["benchmark"] == "parallel"


@pytest.mark.slow  # a worker process and two groups of two: ~60 s of CPU
@pytest.mark.timeout(600)
def test_measure_mode_counts_the_all_to_all_bytes_the_cost_model_predicts(tmp_path):
    argv = [
        "--mode",
        "measure",
        "--preset",
        "tiny",
        "--measure-steps",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--no-reference",
    ]
    report = parallel.main([*argv, "--json", str(tmp_path / "measure.json")])
    assert report["targets"] and all(target["met"] for target in report["targets"]), report["targets"]
    measured = report["results"]["measure"]
    assert measured["one worker"]["sent_bytes_per_step_per_rank"] == {}  # one rank: no collective at all
    ulysses = measured["Ulysses 2"]
    assert (ulysses["ranks"], ulysses["threads_per_rank"]) == (2, 1)  # the same 2 threads as one worker
    sent = ulysses["sent_bytes_per_step_per_rank"]
    assert sent["all_to_all_single"] == pytest.approx(ulysses["cost_model_all_to_all_bytes_per_step"], rel=0.02)
    assert 0 < sent.get("all_gather", 0) + sent.get("all_gather_tensor", 0) < sent["all_to_all_single"]
    assert ulysses["step_ms"]["median"] > 0
    cfg = measured["CFG 2"]
    assert (cfg["ranks"], cfg["threads_per_rank"]) == (2, 1)
    exchanged = cfg["sent_bytes_per_step_per_rank"]
    assert "all_to_all_single" not in exchanged  # each half runs its whole pass: nothing to shard
    assert 0 < exchanged["all_gather"] < sent["all_to_all_single"]  # a velocity a step, against every layer's
    assert json.loads((tmp_path / "measure.json").read_text())["header"]["command"].endswith("measure.json")
