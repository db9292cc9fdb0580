"""The training recipes on two data-parallel trainer ranks, launched as users launch them
(`torchrun --nproc-per-node 2 -m recipes.run CONFIG`, gloo on this CPU): the metrics and the LoRA
(or, with `policy: full`, the weights) of one rank with the same global batch and seed, colocated
(an engine per rank) and separate (rank 0's `mp` engine for both); files written once; a resume
after a SIGKILL of one rank continues the run bitwise. DPO and DiffusionNFT on two ranks: the
update-level tests (tests/trainers_adapters/data_parallel)."""

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

from recipes import checkpoint
from recipes.loading import load_config, recipe_module
from tests.recipes.test_checkpoint_resume import CONFIG, ROOT, TIMINGS, assert_same_lora

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SMALL = [
    "prompts_per_step=3",  # an odd count: the ranks' shares differ (2 and 1 groups)
    "sampling.num_samples=2",
    "sampling.num_inference_steps=3",
    "eval.num_prompts=1",
    "eval.num_samples=1",
    "eval.num_inference_steps=1",
    "steps=3",
]
# Float32 sums in another order (a rank's micro-batches, the gradients' all-reduce) make the ranks'
# run differ from one rank's in the last bits. AdamW divides each gradient by its own running size,
# so a parameter whose gradient is near 0 can move by up to the learning rate (0.01) on such a
# difference, and three steps carry it on. A tenth of one step's lr; measured on this CPU: 1.7e-4
# (NFT), below that for GRPO and DPO. A rank that trained on other samples differs by ~lr.
LORA_ATOL = 1e-3
METRIC_RTOL, METRIC_ATOL = 1e-3, 1e-5
# Every weight trained, sharded with FSDP2 over the ranks (one rank: a group of its own).
FULL = ["policy=full", "optimizer.learning_rate=0.001"]


def overrides(model: str, out: Path, *extra: str) -> list[str]:
    return [f"model.path={model}", f"output_dir={out}", *SMALL, *extra]


def torchrun(config: Path, model: str, out: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["-m", "recipes.run", str(config)]
    for override in overrides(model, out, *extra):
        argv += ["--set", override]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, cwd=out.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finished(process: subprocess.Popen, timeout_s: float = 600) -> str:
    _, stderr = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, stderr.decode()[-4000:]
    return stderr.decode()


def metrics(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if key not in TIMINGS} for record in records]


def assert_close_metrics(ours: list[dict], one_rank: list[dict]) -> None:
    assert [r["step"] for r in ours] == [r["step"] for r in one_rank]  # each step once: rank 0 writes
    for record, expected in zip(ours, one_rank, strict=True):
        assert record.keys() == expected.keys()
        for key, value in expected.items():
            if isinstance(value, float):
                assert record[key] == pytest.approx(value, rel=METRIC_RTOL, abs=METRIC_ATOL), key
            elif key not in ("log_ratio_by_step_max", "log_ratio_by_step_mean"):  # ULPs of ratios near 1
                assert record[key] == value, key


@pytest.mark.parametrize(
    ("recipe", "placement", "policy"),
    [
        ("grpo", ["trainer.placement=colocated"], []),
        ("grpo", ["trainer.placement=separate", "engine.executor=mp"], []),
        ("grpo", ["trainer.placement=colocated"], FULL),
        ("grpo", ["trainer.placement=separate", "engine.executor=mp", "engine.num_workers=2"], FULL),
        ("dpo", ["trainer.placement=colocated"], FULL),
    ],
    ids=[
        "grpo-colocated-uni",
        "grpo-separate-mp",
        "grpo-full-colocated-uni",
        "grpo-full-separate-mp-2-replicas",
        "dpo-full-colocated-uni",
    ],
)
def test_two_ranks_train_as_one_rank(tiny_model, tmp_path, recipe, placement, policy):
    """`placement` for the two ranks (one rank samples in its own process either way), `policy` for both."""
    config = CONFIG.with_name(f"{recipe}_tiny.yaml")
    two = torchrun(config, tiny_model, tmp_path / "two", *placement, *policy)
    recipe_module(recipe).run(load_config(config, overrides(tiny_model, tmp_path / "one", *policy)))
    log = finished(two)
    assert log.count("recipes.training: done in") == 1  # rank 0 speaks for the run
    assert_close_metrics(metrics(tmp_path / "two"), metrics(tmp_path / "one"))
    if policy:
        assert_same_weights(tmp_path / "two" / "weights", tmp_path / "one" / "weights", atol=LORA_ATOL)
    else:
        assert_same_lora(tmp_path / "two" / "lora", tmp_path / "one" / "lora", atol=LORA_ATOL)
    assert (tmp_path / "two" / "summary.json").is_file() and (tmp_path / "two" / "samples_end.png").is_file()


def assert_same_weights(a: Path, b: Path, atol: float = 0.0) -> None:
    """The full policies saved in `a` and `b` (a diffusers folder per denoiser) hold the same
    weights, bitwise or within `atol`; diffusers loads them as plain models."""
    from diffusers import SD3Transformer2DModel

    first = SD3Transformer2DModel.from_pretrained(a / "transformer").state_dict()
    second = SD3Transformer2DModel.from_pretrained(b / "transformer").state_dict()
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=atol, msg=f"the weights differ at {key}")


def test_asynchronous_training_on_two_ranks_trains_as_one_rank(tiny_model, tmp_path):
    config = CONFIG.with_name("grpo_async_tiny.yaml")
    two = torchrun(config, tiny_model, tmp_path / "two")
    recipe_module("grpo").run(load_config(config, overrides(tiny_model, tmp_path / "one")))
    finished(two)
    assert_close_metrics(metrics(tmp_path / "two"), metrics(tmp_path / "one"))
    assert_same_lora(tmp_path / "two" / "lora", tmp_path / "one" / "lora", atol=LORA_ATOL)


def test_a_rank_killed_with_sigkill_resumes_bitwise(tiny_model, tmp_path):
    """Two ranks, checkpoints every step; rank 1 is killed after step 2's checkpoint, torchrun
    stops the run, and `--resume auto` on two ranks gives the run that never stopped, bitwise (the
    full policy's sharded weights and AdamW state gathered into the checkpoint and sharded again)."""
    steps = ["steps=4", "checkpoint_every=1", *FULL]  # the sharded policy: its checkpoint is gathered
    whole = torchrun(CONFIG, tiny_model, tmp_path / "whole", *steps)
    killed = torchrun(CONFIG, tiny_model, tmp_path / "killed", *steps)
    folder = checkpoint.checkpoint_folder(tmp_path / "killed", 2)
    deadline = time.monotonic() + 600
    while not (folder / checkpoint.STATE_FILE).is_file():
        assert killed.poll() is None, killed.stderr.read().decode()[-4000:]
        assert time.monotonic() < deadline, "no checkpoint of step 2 within 600 s"
        time.sleep(0.05)
    ranks = subprocess.run(["pgrep", "-P", str(killed.pid)], capture_output=True, text=True).stdout.split()
    assert len(ranks) == 2, ranks
    os.kill(int(ranks[1]), signal.SIGKILL)
    _, stderr = killed.communicate(timeout=120)
    assert killed.returncode != 0
    assert "Signals.SIGKILL" in stderr.decode() or "SIGKILL" in stderr.decode(), stderr.decode()[-3000:]
    finished(torchrun(CONFIG, tiny_model, tmp_path / "killed", *steps, "resume=auto"))
    finished(whole)
    assert metrics(tmp_path / "killed") == metrics(tmp_path / "whole")
    assert_same_weights(tmp_path / "killed" / "weights", tmp_path / "whole" / "weights")
