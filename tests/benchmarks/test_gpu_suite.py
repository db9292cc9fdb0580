"""benchmarks/gpu_suite runs its parts as `make bench-gpu` does, here CPU-sized: each part writes its
report, a family's pipeline is built once for all its parts, and the page renders without touching
the README. `model_presets.built` reuses only a folder that holds the same preset."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_suite, model_presets, render
from benchmarks.harness import ROOT

pytestmark = pytest.mark.timeout(300)

SMALL = ["--preset", "small", "--device", "cpu", "--dtype", "float32", "--steps", "1", "--batch-size", "1"]


def test_an_unknown_part_is_refused_naming_the_parts(capsys):
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--only", "throughput_sdxl"])
    err = capsys.readouterr().err
    assert "throughput_sdxl" in err and "rescore_sd3" in err and "lora_sd3_mp" in err


def test_a_built_folder_is_reused_for_its_preset_and_refused_for_another(tmp_path):
    folder = tmp_path / "sd3"
    with model_presets.built("sd3", "small", "cpu", torch.float32, folder) as built:
        first = (built / "model_index.json").stat().st_mtime_ns
    with model_presets.built("sd3", "small", "cpu", torch.float32, folder) as built:
        assert (built / "model_index.json").stat().st_mtime_ns == first  # not built again
    with pytest.raises(ValueError, match="holds .*'dtype': 'float32'.*not .*'bfloat16'"):
        with model_presets.built("sd3", "small", "cpu", torch.bfloat16, folder):
            pass
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        with model_presets.built("sd3", "small", "cpu", torch.float32, tmp_path / "other"):
            pass


@pytest.mark.slow
@pytest.mark.timeout(600)  # three parts compile their blocks
def test_the_suite_runs_its_parts_and_renders_their_page(tmp_path):
    results = tmp_path / "gpu"
    argv = [*SMALL, "--warmup", "0", "--repeats", "1", "--results", str(results), "--scratch", str(tmp_path)]
    report = gpu_suite.main([*argv, "--only", "throughput_sd3", "rescore_sd3", "throughput_sd3_mp"])
    assert report["results"]["parts"].keys() == {"throughput_sd3", "rescore_sd3", "throughput_sd3_mp"}
    assert {part["status"] for part in report["results"]["parts"].values()} == {"ok"}
    throughput = json.loads((results / "throughput_sd3.json").read_text())
    assert set(throughput["results"]["modes"]) == {"engine", "diffusers", "floor", "engine compiled"}
    assert throughput["results"]["ratios"]["compiled_speed_vs_diffusers"] > 0
    on_mp = json.loads((results / "throughput_sd3_mp.json").read_text())["results"]
    assert {"engine on mp", "engine compiled on mp"} <= set(on_mp["modes"])
    assert on_mp["ratios"]["engine_compiled_mp_speed_vs_uni"] > 0 and "breakdown" not in on_mp
    rescore = json.loads((results / "rescore_sd3.json").read_text())["results"]
    assert {"rescore", "rescore_eager_trainer"} <= set(rescore["on"])  # a compiled rollout, both trainers
    logs = (results / "logs" / "rescore_sd3.log").read_text()
    assert "--model-folder" in logs
    assert not list(tmp_path.glob("rollout-gpu-suite-*")), "the suite leaves no pipeline behind"
    readme = (ROOT / "README.md").read_text()
    page = render.main(["--results", str(results), "--out", str(tmp_path / "page.md"), "--no-readme"])
    assert "gpu_suite" in page.read_text() and "rollout_throughput" in page.read_text()
    assert (ROOT / "README.md").read_text() == readme
