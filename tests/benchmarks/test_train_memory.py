"""benchmarks/train_memory runs end to end on the tiny SD3: gradient checkpointing lowers the train
step's peak, and the two policies train to the same LoRA."""

from __future__ import annotations

import json

import pytest

from benchmarks import train_memory

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_checkpointing_lowers_the_step_peak_and_trains_the_same_lora(tmp_path):
    path = tmp_path / "train_memory.json"
    argv = ["--presets", "tiny", "--repeats", "1", "--warmup", "0", "--steps", "1", "--json", str(path)]
    report = train_memory.main(argv)
    assert json.loads(path.read_text())["results"] == report["results"]
    tiny = report["results"]["tiny"]
    assert 0 < tiny["checkpointed"]["peak_mb"] < 0.8 * tiny["plain"]["peak_mb"]
    assert tiny["lora_relative_difference"] <= train_memory.LORA_TOLERANCE
    assert all(target["met"] for target in report["targets"])
