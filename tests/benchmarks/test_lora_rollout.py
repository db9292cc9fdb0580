"""benchmarks/lora_rollout runs end to end: its merged modes do run merged, with one merge per
rollout (the benchmark asks the worker after each call), and its report holds every mode beside the
base (and the base again, the noise floor); on "uni" and on "mp", whose steps reach the worker
through the RPC dispatch."""

from __future__ import annotations

import pytest

from benchmarks import lora_rollout

pytestmark = pytest.mark.timeout(300)

ARGV = ["--ranks", "4", "--batch-size", "2", "--steps", "2", "--size", "32", "--repeats", "1", "--warmup", "0"]


@pytest.mark.parametrize("executor", ["uni", pytest.param("mp", marks=pytest.mark.slow)])
def test_the_merged_modes_run_merged_and_are_reported_beside_the_base(tmp_path, executor):
    report = lora_rollout.main([*ARGV, "--executor", executor, "--json", str(tmp_path / "lora_rollout.json")])
    modes = report["results"]["modes"]
    assert set(modes) == {"base", "base again", "merged r4", "unmerged r4"}
    assert all(mode["vs_base"] > 0 and mode["cpu_vs_base"] > 0 for mode in modes.values())
    assert report["results"]["merge"][4]["merge_ms"] > 0
