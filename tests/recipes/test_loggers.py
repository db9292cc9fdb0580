"""The run loggers write what metrics.jsonl holds, and each backend's own reader gets it back:
TensorBoard's EventAccumulator, wandb's `leet inspect` over an offline run's transaction log."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from recipes.loggers import LOGGER_PACKAGES, WandbSection, logger_problems, open_loggers, scalar_metrics

pytestmark = pytest.mark.timeout(120)

# Two steps as train() writes them: numbers, a list, a null, and the per-denoising-step dicts.
RECORDS = [
    {
        "step": step,
        "reward_mean": -0.5 + 0.25 * step,
        "num_samples": 6,
        "log_ratio_before_update": 3e-7 * (step + 1),
        "log_ratio_by_step_max": {0: 1e-7 * (step + 1), 2: 3e-7 * (step + 1)},
        "log_ratio_by_step_mean": {0: 5e-8, 2: 2e-7},
        "sde_window": [0, 3] if step == 0 else None,
    }
    for step in range(2)
]
CONFIG = {"recipe": "grpo", "steps": 2, "sampling": {"num_inference_steps": 3}}


def sample_files(folder: Path) -> dict[str, Path]:
    """A PNG grid and an animated GIF grid (what a video model's run writes)."""
    png = folder / "grid.png"
    Image.new("RGB", (12, 8), "red").save(png)
    frames = [Image.new("RGB", (12, 8), colour) for colour in ("red", "blue", "green")]
    gif = folder / "grid.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=125, loop=0)
    return {"samples_start": png, "samples_video": gif}


def test_scalars_are_the_numbers_of_a_record_with_one_per_denoising_step():
    assert scalar_metrics(RECORDS[1]) == {
        "reward_mean": -0.25,
        "num_samples": 6.0,
        "log_ratio_before_update": 6e-7,
        "log_ratio_by_step_max/step_00": 2e-7,
        "log_ratio_by_step_max/step_02": 6e-7,
        "log_ratio_by_step_mean/step_00": 5e-8,
        "log_ratio_by_step_mean/step_02": 2e-7,
    }
    # Read back from metrics.jsonl, where the step indices are text: the same names.
    assert scalar_metrics(json.loads(json.dumps(RECORDS[1]))) == scalar_metrics(RECORDS[1])


def test_the_logger_key_names_unknown_loggers_and_the_extra_of_a_missing_package(monkeypatch):
    assert logger_problems("jsonl") == logger_problems(["jsonl", "tensorboard", "wandb"]) == []
    (unknown,) = logger_problems(["jsonl", "mlflow"])
    assert "'mlflow' is unknown" in unknown and "jsonl, tensorboard, wandb" in unknown
    assert "logger is empty" in logger_problems([])[0]
    # As if tensorboard were not installed: the module it looks for does not exist.
    monkeypatch.setitem(LOGGER_PACKAGES, "tensorboard", ("no_such_module_here", "tensorboard"))
    (missing,) = logger_problems(["tensorboard"])
    assert "pip install 'diffusion-rollout[tensorboard]'" in missing


def test_a_bad_wandb_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of .*'offline'"):
        WandbSection(mode="offlne")


def test_tensorboard_holds_the_scalars_of_metrics_jsonl_the_grids_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = sample_files(tmp_path)
    with open_loggers(["jsonl", "tensorboard"], tmp_path, CONFIG, WandbSection()) as loggers:
        loggers.log_images(0, images)
        for record in RECORDS:
            loggers.log_scalars(record["step"], record)

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == json.loads(json.dumps(RECORDS))  # exactly the records, as before loggers existed
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    expected = {}  # name -> [(step, value)]
    for line in lines:
        for name, value in scalar_metrics(line).items():
            expected.setdefault(name, []).append((line["step"], value))
    assert set(events.Tags()["scalars"]) == set(expected)
    for name, points in expected.items():
        logged = [(event.step, event.value) for event in events.Scalars(name)]
        assert logged == [(step, pytest.approx(value, rel=1e-6)) for step, value in points]  # float32
    for tag, path in images.items():
        (image,) = events.Images(tag)
        assert image.encoded_image_string == path.read_bytes()  # the GIF stays animated
        assert (image.width, image.height) == (12, 8)
    (config_text,) = events.Tensors("config/text_summary")
    assert '"num_inference_steps": 3' in config_text.tensor_proto.string_val[0].decode()


def wandb_records(output_dir: Path) -> list[dict]:
    """The records of the offline run under `output_dir`, as wandb's own reader prints them."""
    (run_dir,) = (output_dir / "wandb").glob("offline-run-*")
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    printed = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout
    return [json.loads(line) for line in printed.splitlines()]


def test_wandb_offline_writes_the_scalars_grids_and_config_of_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the section's mode is null: wandb reads the environment
    monkeypatch.setenv("WANDB_SILENT", "true")
    images = sample_files(tmp_path)
    with open_loggers(["wandb"], tmp_path, CONFIG, WandbSection(name="tiny-run")) as loggers:
        for record in RECORDS:
            loggers.log_scalars(record["step"], record)
        loggers.log_images(len(RECORDS), images)

    records = wandb_records(tmp_path)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "tiny-run" and run["project"] == "diffusion-rollout"
    assert run["config"]["update"]["sampling"] == {"num_inference_steps": 3}
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [row["_step"] for row in history] == [0, 1, 2]
    for row, record in zip(history, RECORDS, strict=False):
        logged = {name: value for name, value in row.items() if not name.startswith("_")}
        assert logged == pytest.approx(scalar_metrics(record), rel=1e-12)
    # The grids as media (the GIF as a video), byte for byte the files the run wrote.
    assert (history[2]["samples_start._type"], history[2]["samples_video._type"]) == ("image-file", "video-file")
    for tag, path in images.items():
        assert history[2][f"{tag}.sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        (stored,) = (tmp_path / "wandb").glob(f"offline-run-*/files/{history[2][f'{tag}.path']}")
        assert stored.read_bytes() == path.read_bytes()
