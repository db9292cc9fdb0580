"""The GRPO and DPO recipes end to end through the real `python -m recipes.run` entry point, on the
tiny model, with the in-process and the worker-process executor."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import recipes.config
from rollout.rescoring import RATIO_TOLERANCE

CONFIG_DIR = Path(recipes.config.__file__).parent / "configs"
STEPS = 3


def run_cli(monkeypatch, config: str, *overrides: str) -> None:
    argv = ["recipes/run.py", str(CONFIG_DIR / config)]
    for override in overrides:
        argv += ["--set", override]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_module("recipes.run", run_name="__main__")


def small_run(tmp_path: Path, executor: str) -> list[str]:
    return [
        f"output_dir={tmp_path / 'out'}",
        f"model.tiny_cache_dir={tmp_path / 'tiny'}",
        f"engine.executor={executor}",
        f"engine.num_workers={2 if executor == 'mp' else 1}",
        f"steps={STEPS}",
        "prompts_per_step=2",
        "sampling.num_samples=3",
        "sampling.num_inference_steps=3",
        "eval.num_prompts=2",
        "eval.num_samples=2",
        "eval.num_inference_steps=3",
    ]


def check_run_files(out: Path) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    versions = [r["weight_version"] for r in records]
    assert versions == sorted(set(versions)), "every step pushed a new weight version"
    for name in ("reward.png", "samples_start.png", "samples_end.png"):
        with Image.open(out / name) as image:
            assert image.size[0] > 0
    with Image.open(out / "samples_start.png") as start, Image.open(out / "samples_end.png") as end:
        assert start.size == end.size == (2 * 32 * 4 + 2, 2 * 32 * 4 + 2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_weight_version"] == versions[-1]
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    return records, summary


# runpy warns that recipes.run is already imported when another test imported it first.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("executor", ["uni", pytest.param("mp", marks=pytest.mark.slow)])
def test_grpo_recipe_runs_and_starts_at_ratio_one(tmp_path, monkeypatch, executor, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recipes.loggers import scalar_metrics

    caplog.set_level("INFO", logger="recipes.training")
    run_cli(monkeypatch, "grpo_tiny.yaml", *small_run(tmp_path, executor), "logger=[jsonl, tensorboard]")
    out = tmp_path / "out"
    records, summary = check_run_files(out)
    assert summary["log_ratio_before_first_update"] < RATIO_TOLERANCE
    assert summary["log_ratio_before_update_max"] < RATIO_TOLERANCE
    assert all(r["log_ratio_before_update"] < RATIO_TOLERANCE for r in records)
    assert all(r["num_transitions"] == 2 * 3 * 3 for r in records)  # prompts x group x SDE steps
    assert "policy ratio before the first update" in caplog.text
    # The agreement of every denoising step (one minibatch: all 3), every training step, and its plot.
    for record in records:
        assert list(record["log_ratio_by_step_max"]) == list(record["log_ratio_by_step_mean"]) == ["0", "1", "2"]
        assert all(value < RATIO_TOLERANCE for value in record["log_ratio_by_step_max"].values())
    with Image.open(out / "log_ratio.png") as plot:
        assert plot.size[0] > 0
    # TensorBoard got the same scalars and the grids of the start and the end (after the last step).
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert events.Scalars("log_ratio_by_step_max/step_02")[-1].step == STEPS - 1
    for name, value in scalar_metrics(records[-1]).items():
        assert events.Scalars(name)[-1].value == pytest.approx(value, rel=1e-6)
    assert [event.step for event in events.Images("samples_start")] == [0]
    assert [event.step for event in events.Images("samples_end")] == [STEPS]
    assert events.Images("samples_end")[0].encoded_image_string == (out / "samples_end.png").read_bytes()


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "config",
    [
        "grpo_flux_tiny.yaml",
        "grpo_qwen_image_tiny.yaml",
        pytest.param("grpo_flux2_klein_tiny.yaml", marks=pytest.mark.slow),
        pytest.param("grpo_zimage_tiny.yaml", marks=pytest.mark.slow),  # slow as Z-Image's matrix tests
    ],
)
def test_family_recipes_run_and_start_at_ratio_one(tmp_path, monkeypatch, config):
    run_cli(monkeypatch, config, *small_run(tmp_path, "uni"))
    records, summary = check_run_files(tmp_path / "out")
    assert summary["log_ratio_before_update_max"] < RATIO_TOLERANCE
    assert all(r["num_transitions"] == 2 * 3 * 3 for r in records)


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["wan", "wan22"])
def test_the_video_recipe_writes_animated_grids_and_starts_at_ratio_one(tmp_path, monkeypatch, family):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    overrides = f"model.tiny_family={family}", "logger=[jsonl, tensorboard]"
    run_cli(monkeypatch, "grpo_wan_tiny.yaml", *small_run(tmp_path, "uni"), *overrides)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["log_ratio_before_update"] < RATIO_TOLERANCE for r in records)
    for name in ("samples_start.gif", "samples_end.gif"):
        with Image.open(out / name) as grid:
            assert grid.n_frames == 9 and grid.size == (2 * 32 * 4 + 2, 2 * 32 * 4 + 2)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    (end,) = events.Images("samples_end")
    assert end.encoded_image_string == (out / "samples_end.gif").read_bytes()  # animated in TensorBoard too
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (out / "lora" / "pytorch_lora_weights_transformer_2.safetensors").is_file() == (family == "wan22")


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("executor", ["uni", pytest.param("mp", marks=pytest.mark.slow)])
def test_dpo_recipe_runs(tmp_path, monkeypatch, executor):
    weighted_sum = "reward={colour: 1.0, jpeg_compressibility: 0.01}"
    run_cli(monkeypatch, "dpo_tiny.yaml", *small_run(tmp_path, executor), weighted_sum)
    records, _ = check_run_files(tmp_path / "out")
    for r in records:  # each component's mean is logged; the reward is their weighted sum
        total = r["reward/colour"] + 0.01 * r["reward/jpeg_compressibility"]
        assert r["reward_mean"] == pytest.approx(total, abs=1e-6)
    assert all(r["num_pairs"] == 2 for r in records)
    assert not any(key.startswith("log_ratio") for key in records[0])  # DPO has no policy ratio
    assert not (tmp_path / "out" / "log_ratio.png").exists()
    assert records[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as the reference


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.timeout(300)
def test_final_lora_loads_into_diffusers_and_the_engine(tmp_path, monkeypatch):
    from diffusers import StableDiffusion3Pipeline

    from rollout import EngineConfig, RolloutEngine, SamplingParams
    from rollout.lora.manager import read_lora_folder

    run_cli(monkeypatch, "grpo_tiny.yaml", *small_run(tmp_path, "uni"), "lora.rank=4", "lora.alpha=16")
    lora_dir = tmp_path / "out" / "lora"
    tensors, config = read_lora_folder(lora_dir)
    assert (config.r, config.lora_alpha) == (4, 16)  # the config travels in the file's metadata
    assert any(t.abs().sum() > 0 for k, t in tensors.items() if ".lora_B." in k), "the LoRA was trained"

    pipeline = StableDiffusion3Pipeline.from_pretrained(tmp_path / "tiny")
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    embeds = torch.randn(1, 77, 64, generator=torch.Generator().manual_seed(1))
    pooled = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))

    def velocity():
        with torch.no_grad():
            return pipeline.transformer(latents, embeds, pooled, torch.tensor([500.0]), return_dict=False)[0]

    base = velocity()
    pipeline.load_lora_weights(lora_dir)
    assert not torch.allclose(velocity(), base), "diffusers applied the trained LoRA"

    with RolloutEngine(EngineConfig(model=str(tmp_path / "tiny"))) as engine:
        engine.load_lora("trained", str(lora_dir))
        assert engine.lora_modules("trained") == 15  # 8 projections x 2 blocks; the last has no to_add_out
        outputs = engine.generate("a red square", SamplingParams(num_inference_steps=2, lora="trained", seed=0))
        assert outputs[0].lora == "trained"


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.timeout(300)
def test_a_sliding_sde_window_moves_each_step_with_its_branch_and_stays_at_ratio_one(tmp_path, monkeypatch):
    """Flow-GRPO-Fast with the window drawn per step: the tree branches where the window starts
    (a branch left behind would sit on an ODE step and be refused) and trains only its 2 steps.
    The children draw at BranchGRPO's 4x noise, and the eval's plain samples drop the scale."""
    out = tmp_path / "out"
    run_cli(
        monkeypatch,
        "grpo_fast_tiny.yaml",
        f"output_dir={out}",
        f"model.tiny_cache_dir={tmp_path / 'tiny'}",
        f"steps={STEPS}",
        "prompts_per_step=1",
        "sampling.num_inference_steps=6",
        "sampling.sde_window=[4, 6]",
        "sampling.branch_steps=[4]",
        "sampling.branch_factor=3",
        "sampling.branch_noise_scale=4.0",
        "sde_window_range=[0, 6]",
        "eval.num_prompts=1",
        "eval.num_samples=1",
        "eval.num_inference_steps=2",
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [tuple(r["sde_window"]) for r in records]
    assert all(0 <= start and stop == start + 2 <= 6 for start, stop in windows)
    assert len(set(windows)) > 1, windows  # seed 0 draws different places
    assert all(r["num_transitions"] == 3 * 2 for r in records)  # 3 leaves x the window's 2 steps
    assert all(r["log_ratio_before_update"] < RATIO_TOLERANCE for r in records)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.timeout(300)
def test_grpo_trains_on_reward_models_from_local_folders(tmp_path, monkeypatch, tiny_clip, tiny_aesthetic_head):
    """The recipe builds CLIP score and the aesthetic head from their folders (tiny and random
    here) and logs both with the built-in they are summed with."""
    reward = (
        f"reward={{clip_score: {{weight: 0.01, model: {tiny_clip}, batch_size: 2}}, "
        f"aesthetic: {{weight: 1.0, model: {tiny_clip}, head: {tiny_aesthetic_head}}}, colour: 1.0}}"
    )
    run_cli(monkeypatch, "grpo_tiny.yaml", *small_run(tmp_path, "uni"), reward)
    records, summary = check_run_files(tmp_path / "out")
    for r in records:
        total = 0.01 * r["reward/clip_score"] + r["reward/aesthetic"] + r["reward/colour"]
        assert r["reward_mean"] == pytest.approx(total, abs=1e-5)
        assert 0 <= r["reward/clip_score"] <= 100
    assert summary["log_ratio_before_update_max"] < RATIO_TOLERANCE


@pytest.mark.slow  # two runs, one of them with a reward worker process
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.timeout(300)
def test_a_run_with_a_reward_worker_gets_the_rewards_of_a_run_without(tmp_path, monkeypatch, tiny_clip):
    reward = f"reward={{clip_score: {{weight: 0.01, model: {tiny_clip}}}, colour: 1.0}}"
    found = {}
    for workers in (0, 1):
        folder = tmp_path / f"workers{workers}"
        placed = [f"reward_workers={workers}"] + (["reward_devices=[cpu]"] if workers else [])
        run_cli(monkeypatch, "grpo_tiny.yaml", *small_run(folder, "uni"), reward, *placed)
        records, _ = check_run_files(folder / "out")
        found[workers] = [r[name] for r in records for name in ("reward_mean", "reward/clip_score", "reward/colour")]
    assert found[1] == pytest.approx(found[0], abs=1e-6)
