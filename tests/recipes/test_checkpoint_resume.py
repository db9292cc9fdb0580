"""Checkpoints and resume of the training recipes: a run stopped after a checkpoint and resumed
gives, bitwise on CPU, the rewards, metrics and final LoRA of the run that never stopped; in
process, after a SIGKILL of the real `python -m recipes.run`, and against a rollout server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import recipes.config
from recipes import checkpoint
from recipes.grpo import run
from recipes.loading import load_config, recipe_module
from rollout.lora.manager import read_lora_folder

CONFIG = Path(recipes.config.__file__).parent / "configs" / "grpo_tiny.yaml"
ROOT = Path(recipes.config.__file__).parent.parent
SMALL = [
    "prompts_per_step=1",
    "sampling.num_samples=2",
    "sampling.num_inference_steps=2",
    "eval.num_prompts=1",
    "eval.num_samples=1",
    "eval.num_inference_steps=1",
]
# what a resume may change
TIMINGS = {"rollout_s", "reward_wait_s", "update_s", "push_s", "trainer_wait_s", "wall_s", "behaviour_rescore_s"}


def settings(model: str, out: Path, *extra: str) -> list[str]:
    return [f"model.path={model}", f"output_dir={out}", *SMALL, *extra]


def metrics(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if key not in TIMINGS} for record in records]


def assert_same_lora(a: Path, b: Path, rtol: float = 0.0, atol: float = 0.0) -> None:
    """The trained LoRAs in folders `a` and `b` are the same: bitwise, or within `rtol` / `atol`."""
    first, _ = read_lora_folder(a)
    second, _ = read_lora_folder(b)
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=rtol, atol=atol, msg=f"the LoRAs differ at {key}")
    assert any(t.abs().sum() > 0 for key, t in first.items() if ".lora_B." in key), "the LoRA was trained"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "recipe", ["grpo", pytest.param("dpo", marks=pytest.mark.slow), pytest.param("nft", marks=pytest.mark.slow)]
)
def test_a_run_resumed_from_its_checkpoint_is_the_run_that_never_stopped(tiny_model, tmp_path, recipe):
    config = CONFIG.with_name(f"{recipe}_tiny.yaml")
    train = recipe_module(recipe).run
    whole = train(load_config(config, settings(tiny_model, tmp_path / "whole", "steps=2")))
    logged = "logger=[jsonl, tensorboard]" if recipe == "grpo" else "logger=jsonl"
    train(load_config(config, settings(tiny_model, tmp_path / "cut", "steps=1", "checkpoint_every=1", logged)))
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "cut")] == ["step-000001"]
    # NFT's old adapter and its EMA clock travel with the checkpoint (its metrics depend on both)
    assert (checkpoint.checkpoints(tmp_path / "cut")[0] / checkpoint.OLD_POLICY).is_dir() == (recipe == "nft")
    if recipe == "grpo":
        check_refusals(tiny_model, tmp_path / "cut")
    resumed = train(load_config(config, settings(tiny_model, tmp_path / "cut", "steps=2", "resume=auto", logged)))
    assert metrics(tmp_path / "cut") == metrics(tmp_path / "whole")
    if recipe == "grpo":  # TensorBoard holds each step once, across the two segments' event files
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "cut" / "tensorboard"))
        events.Reload()
        scalars = events.Scalars("reward_mean")
        expected = metrics(tmp_path / "whole")
        assert [event.step for event in scalars] == [record["step"] for record in expected]
        assert [event.value for event in scalars] == pytest.approx([record["reward_mean"] for record in expected])
    assert_same_lora(tmp_path / "cut" / "lora", tmp_path / "whole" / "lora")
    assert resumed["eval_reward_start"] == whole["eval_reward_start"]
    assert resumed["eval_reward_end"] == whole["eval_reward_end"]
    pushes = 2 if recipe == "nft" else 1  # NFT pushes its old adapter after the policy's
    assert resumed["final_weight_version"] == whole["final_weight_version"] == 3 * pushes  # numbering went on


def check_refusals(model: str, out: Path) -> None:
    """What a resume (or a new run) in `out`, which holds the checkpoint of step 1, refuses."""
    with pytest.raises(ValueError, match="cannot resume .* seed: 0 in the checkpoint, 3 now.*Resume with the"):
        run(load_config(CONFIG, settings(model, out, "steps=2", "seed=3", "resume=auto")))
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run .* --resume"):
        load_config(CONFIG, settings(model, out, "steps=2"))
    with pytest.raises(ValueError, match="is neither a checkpoint folder"):
        load_config(CONFIG, settings(model, out.parent / "new", f"resume={out.parent / 'nothing'}"))
    with pytest.raises(ValueError, match="checkpoint_every must be >= 0"):
        load_config(CONFIG, settings(model, out.parent / "new", "checkpoint_every=-1"))


def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(tiny_model, tmp_path, monkeypatch):
    from trainers_adapters.policy.lora_policy import LoraPolicy

    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, {"r": 2, "lora_alpha": 2, "target_modules": ["to_q"], "init_lora_weights": False})
    optimizer = torch.optim.AdamW(policy.parameters())
    state = checkpoint.TrainingState(
        step=1, weight_version=2, history=[{"step": 0}], eval_reward_start=0.5, train_s=1.0, config={}, rng={}
    )
    checkpoint.write_checkpoint(tmp_path, state, policy, optimizer)
    step_two = checkpoint.TrainingState(**{**vars(state), "step": 2})
    saved = policy.lora_state()
    with torch.no_grad():
        policy.parameters()[0].add_(1.0)

    def crash(source, target):  # the power goes out just before the new checkpoint is published
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.write_checkpoint(
            tmp_path, checkpoint.TrainingState(**{**vars(state), "step": 2}), policy, optimizer
        )
    monkeypatch.undo()
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000001"]
    assert checkpoint.resume_folder("auto", tmp_path).name == "step-000001"
    read, _ = checkpoint.read_checkpoint(checkpoint.checkpoints(tmp_path)[0])
    assert (read.step, read.weight_version, read.history) == (1, 2, [{"step": 0}])
    policy.load(checkpoint.checkpoints(tmp_path)[0] / "lora")
    assert all(torch.equal(saved[key], tensor) for key, tensor in policy.lora_state().items())
    # The next write clears what the crash left, and keeps only the latest.
    checkpoint.write_checkpoint(tmp_path, step_two, policy, optimizer)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002"]


def test_a_resume_whose_config_changes_the_run_is_refused_naming_the_keys(tmp_path):
    saved = {"steps": 4, "seed": 0, "sampling": {"noise_level": 0.7}, "engine": {"url": None}, "output_dir": "a"}
    now = {"steps": 8, "seed": 1, "sampling": {"noise_level": 0.5}, "engine": {"url": "http://x"}, "output_dir": "b"}
    assert checkpoint.config_differences(saved, now) == [
        "sampling.noise_level: 0.7 in the checkpoint, 0.5 now",
        "seed: 0 in the checkpoint, 1 now",
    ]


def start_cli(model: str, out: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "recipes.run", str(CONFIG)]
    for override in settings(model, out, *extra):
        argv += ["--set", override]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, cwd=tmp_cwd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def tmp_cwd(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.parent


def kill_after_checkpoint(process: subprocess.Popen, out: Path, step: int, lines: int, timeout_s: float = 300) -> None:
    """SIGKILL `process` once the checkpoint of `step` is on disk and metrics.jsonl has `lines`
    lines: the steps after the checkpoint, which the resume must drop and redo."""
    deadline = time.monotonic() + timeout_s

    def written() -> int:
        path = out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    while not ((checkpoint.checkpoint_folder(out, step) / checkpoint.STATE_FILE).is_file() and written() >= lines):
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of step {step} and {lines} steps within {timeout_s} s"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    assert written() > step, "the kill came after steps past the checkpoint"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_twenty_steps_equal_ten_killed_with_sigkill_and_ten_resumed(tiny_model, tmp_path):
    """The issue's check: a run of 20 steps, and one killed with SIGKILL two steps after its
    step-10 checkpoint and resumed with `--resume`, give the same rewards and the same LoRA."""
    whole = start_cli(tiny_model, tmp_path / "whole", "steps=20")
    killed = start_cli(tiny_model, tmp_path / "killed", "steps=20", "checkpoint_every=5")
    kill_after_checkpoint(killed, tmp_path / "killed", 10, lines=12)
    assert whole.wait(timeout=600) == 0, whole.stderr.read().decode()[-3000:]
    latest = checkpoint.checkpoints(tmp_path / "killed")[-1]
    resumed = subprocess.run(
        [sys.executable, "-m", "recipes.run", str(CONFIG), "--resume", str(tmp_path / "killed")]
        + [arg for override in settings(tiny_model, tmp_path / "killed", "steps=20") for arg in ("--set", override)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    assert f"resuming from {latest}" in resumed.stderr.decode()
    assert metrics(tmp_path / "killed") == metrics(tmp_path / "whole")
    assert [r["step"] for r in metrics(tmp_path / "killed")] == list(range(20))
    assert_same_lora(tmp_path / "killed" / "lora", tmp_path / "whole" / "lora")
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("killed", "whole")]
    for key in ("eval_reward_start", "eval_reward_end", "final_weight_version", "reward_margin"):
        assert summaries[0][key] == summaries[1][key], key


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_trainer_killed_and_resumed_against_the_same_server_continues_its_versions(
    tiny_model, tmp_path, monkeypatch
):
    """The server outlives the trainer: the resumed trainer re-pushes the checkpoint's LoRA with the
    checkpoint's version, so the versions go on one per step, and the samples are the same as
    those of an unbroken run against the same server."""
    from rollout.serve.launch import ServerProcess

    monkeypatch.setenv("ROLLOUT_API_KEY", "resume-key")
    with ServerProcess.start(tiny_model, api_key="resume-key") as server:
        remote = f"engine.url={server.url}"
        whole = run(load_config(CONFIG, settings(tiny_model, tmp_path / "whole", "steps=6", remote)))
        killed = start_cli(tiny_model, tmp_path / "killed", "steps=6", "checkpoint_every=3", remote)
        kill_after_checkpoint(killed, tmp_path / "killed", 3, lines=4)
        versions_at_kill = json.loads(
            (checkpoint.checkpoint_folder(tmp_path / "killed", 3) / checkpoint.STATE_FILE).read_text()
        )["weight_version"]
        run(load_config(CONFIG, settings(tiny_model, tmp_path / "killed", "steps=6", "resume=auto", remote)))
    records = metrics(tmp_path / "killed")
    versions = [r.pop("weight_version") for r in records]
    assert versions[2] == versions_at_kill
    assert versions == list(range(versions[0], versions[0] + 6)), versions  # one per step, across the kill
    unbroken = metrics(tmp_path / "whole")
    for record in unbroken:
        record.pop("weight_version")
    assert records == unbroken
    assert_same_lora(tmp_path / "killed" / "lora", tmp_path / "whole" / "lora")
    assert (
        whole["eval_reward_start"]
        == json.loads((tmp_path / "killed" / "summary.json").read_text())["eval_reward_start"]
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_resumed_against_a_restarted_server_pushes_again_and_continues(tiny_model, tmp_path, monkeypatch):
    """The server restarts between a checkpoint and the resume (its adapter gone, its version back
    at 0): the resumed run pushes the checkpoint's LoRA with the checkpoint's version, so the
    versions go on, and its samples are those of an unbroken run."""
    from urllib.parse import urlsplit

    from rollout.errors import EngineDeadError
    from rollout.serve.client import RemoteRolloutEngine
    from rollout.serve.launch import ServerProcess

    monkeypatch.setenv("ROLLOUT_API_KEY", "resume-key")
    with ServerProcess.start(tiny_model, api_key="resume-key") as server:
        remote, port = f"engine.url={server.url}", urlsplit(server.url).port
        run(load_config(CONFIG, settings(tiny_model, tmp_path / "whole", "steps=4", remote)))
        run(load_config(CONFIG, settings(tiny_model, tmp_path / "cut", "steps=2", "checkpoint_every=2", remote)))
        client = RemoteRolloutEngine(server.url, "resume-key")
        version_before = client.weight_version
    with ServerProcess.start(tiny_model, api_key="resume-key", port=port) as restarted:
        with pytest.raises(EngineDeadError, match="restarted"):
            _ = client.weight_version  # the old server's client does not mistake the new one for it
        run(load_config(CONFIG, settings(tiny_model, tmp_path / "cut", "steps=4", "resume=auto", remote)))
        with RemoteRolloutEngine(restarted.url, "resume-key") as fresh:
            assert fresh.weight_version == version_before + 2
    client.shutdown()
    records, unbroken = metrics(tmp_path / "cut"), metrics(tmp_path / "whole")
    versions = [r.pop("weight_version") for r in records]
    assert versions == list(range(versions[0], versions[0] + 4)), versions  # on across the restart
    for record in unbroken:
        record.pop("weight_version")
    assert records == unbroken
    assert_same_lora(tmp_path / "cut" / "lora", tmp_path / "whole" / "lora")
