"""Asynchronous GRPO (`recipes.async_rollouts`): with max_staleness 0 it is the synchronous run
bitwise; with N >= 1 each step's samples are exactly min(step, N) versions old, every step holds
them to the re-scoring contract with the adapter that sampled them, the run is the same whatever
the timing, a resume from a checkpoint repeats it bitwise, and a killed reward worker or rollout
worker fails the run promptly, as in the synchronous loop."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time

import pytest

from recipes import checkpoint
from recipes.grpo import run
from recipes.loading import load_config
from rollout.engine.rollout_engine import RolloutEngine
from rollout.rescoring import RATIO_TOLERANCE
from tests.recipes.test_checkpoint_resume import CONFIG, assert_same_lora, metrics, settings
from trainers_adapters.grpo.trainer import PolicyDriftError

pytestmark = pytest.mark.timeout(240)

CORRECTED = "grpo.off_policy_correction=tis"


def train(model, out, *extra):
    return run(load_config(CONFIG, settings(model, out, CORRECTED, *extra)))


def test_max_staleness_zero_is_the_synchronous_run_bitwise(tiny_model, tmp_path):
    sync = train(tiny_model, tmp_path / "sync", "steps=3")
    ahead = train(tiny_model, tmp_path / "ahead", "steps=3", "asynchronous.max_staleness=0")
    assert metrics(tmp_path / "ahead") == metrics(tmp_path / "sync")
    assert_same_lora(tmp_path / "ahead" / "lora", tmp_path / "sync" / "lora")
    assert (ahead["eval_reward_end"], ahead["final_weight_version"]) == (sync["eval_reward_end"], 4)
    assert all(record["sample_staleness"] == {"0": 2} for record in metrics(tmp_path / "ahead"))


@pytest.mark.parametrize("staleness", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_samples_are_min_step_n_versions_old_and_a_resume_repeats_the_run_bitwise(tiny_model, tmp_path, staleness):
    option = f"asynchronous.max_staleness={staleness}"
    whole = train(tiny_model, tmp_path / "whole", "steps=4", option)
    records = metrics(tmp_path / "whole")
    assert [r["sample_staleness"] for r in records] == [{str(min(step, staleness)): 2} for step in range(4)]
    assert [r["weight_version"] for r in records] == [2, 3, 4, 5]  # the synchronous loop's numbering
    # Every step: step 0's samples re-scored by the policy itself, the stale ones by the adapter that sampled them.
    assert all(r["log_ratio_before_update"] < RATIO_TOLERANCE for r in records)
    assert all(r["importance_weight_std"] > 0 for r in records[1:])
    # Cut after 2 steps, its checkpoint keeping the adapters the next rollouts sample with, and resumed.
    train(tiny_model, tmp_path / "cut", "steps=2", "checkpoint_every=2", option)
    saved = checkpoint.read_behaviour(checkpoint.checkpoints(tmp_path / "cut")[-1])
    assert sorted(saved) == list(range(max(0, 2 - staleness), 2))
    resumed = train(tiny_model, tmp_path / "cut", "steps=4", "resume=auto", option)
    assert metrics(tmp_path / "cut") == records
    assert_same_lora(tmp_path / "cut" / "lora", tmp_path / "whole" / "lora")
    assert resumed["eval_reward_end"] == whole["eval_reward_end"]
    # And again: the timing of the two threads does not change the run.
    train(tiny_model, tmp_path / "again", "steps=4", option)
    assert metrics(tmp_path / "again") == records


def test_a_step_whose_samples_another_adapter_drew_stops_the_asynchronous_run(tiny_model, tmp_path, monkeypatch):
    """Each step's stale samples are re-scored by the adapter that sampled them and held to
    max_log_ratio_before_update, as the synchronous loop holds the policy's own: a step whose
    samples the engine drew with another adapter than the trainer's of that version stops the
    run with PolicyDriftError before it trains."""
    sampler_load = RolloutEngine.load_lora

    def load_changed(engine, name, source, config=None, *, version=None, check_finite=True):
        # The sampler's pushes (each with its version; the first push has none) reach the engine changed.
        if version is not None:
            source = {key: t + 1e-2 if ".lora_B." in key else t for key, t in source.items()}
        return sampler_load(engine, name, source, config, version=version, check_finite=check_finite)

    monkeypatch.setattr(RolloutEngine, "load_lora", load_changed)
    with pytest.raises(PolicyDriftError, match="a behaviour adapter is not the one the engine sampled its version"):
        train(tiny_model, tmp_path / "changed", "steps=3", "asynchronous.max_staleness=1")
    # Steps 0 and 1 sample with the first adapter, pushed unchanged; step 2's is the sampler's first push.
    records = [json.loads(line) for line in (tmp_path / "changed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["log_ratio_before_update"] < RATIO_TOLERANCE for r in records)
    assert records[0]["behaviour_rescore_s"] == 0 < records[1]["behaviour_rescore_s"]  # step 1's samples are stale


def _train_in_thread(*args) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target():
        try:
            outcome["summary"] = train(*args)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def _wait_for_steps(out, count: int, thread: threading.Thread, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= count):
        assert thread.is_alive(), "the run ended before the kill"
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["reward", "rollout"])
def test_a_killed_worker_ends_or_heals_the_asynchronous_run_within_seconds(tiny_model, tmp_path, worker, caplog):
    """As in the synchronous loop: a dead rollout worker kills the engine, and the run fails with
    it; a reward worker killed between groups is replaced (and the run goes on), one killed while
    it scores a group fails that step. Never a hang."""
    extra = ["reward_workers=1"] if worker == "reward" else ["engine.executor=mp"]
    others = set(multiprocessing.active_children())  # other tests' workers, left alone
    # Long enough that the kill lands mid-run: a step of 4 samples of 8 denoising steps.
    thread, outcome = _train_in_thread(
        tiny_model,
        tmp_path / "run",
        "steps=40",
        "asynchronous.max_staleness=1",
        "sampling.num_samples=4",
        "sampling.num_inference_steps=8",
        *extra,
    )
    _wait_for_steps(tmp_path / "run", 2, thread)
    workers = set(multiprocessing.active_children()) - others
    assert workers, f"no {worker} worker process to kill"
    for child in workers:
        child.kill()
    killed = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the run hangs after its worker died"
    assert time.monotonic() - killed < 30
    if worker == "rollout" or "error" in outcome:
        assert "error" in outcome, "the run finished without its engine's worker"
        # the engine's EngineDeadError ("worker rank 0 (pid ...) died (exit code -9) ..."), or the reward's
        assert "died" in str(outcome["error"]) or "reward" in str(outcome["error"]).lower()
        assert len(metrics(tmp_path / "run")) < 40
    else:
        assert "reward worker 0 was gone; starting a new one" in caplog.text
        assert len(metrics(tmp_path / "run")) == 40


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_paused_rollout_service_holds_the_asynchronous_run_which_then_goes_on_as_unpaused(
    tiny_model, tmp_path, monkeypatch
):
    """An operator pauses the rollout service (mode keep) in the middle of an asynchronous run and
    resumes it: the run waits, then finishes with the samples, rewards and LoRA of a run without
    the pause, as a synchronous run would."""
    from rollout.serve.client import RemoteRolloutEngine
    from rollout.serve.launch import ServerProcess

    monkeypatch.setenv("ROLLOUT_API_KEY", "pause-key")
    option = "asynchronous.max_staleness=1"
    with ServerProcess.start(tiny_model, api_key="pause-key") as server:
        remote = f"engine.url={server.url}"
        train(tiny_model, tmp_path / "whole", "steps=6", option, remote)
        thread, outcome = _train_in_thread(tiny_model, tmp_path / "paused", "steps=6", option, remote)
        _wait_for_steps(tmp_path / "paused", 2, thread)
        operator = RemoteRolloutEngine(server.url)
        operator.pause("keep")
        time.sleep(1.0)
        held = len(metrics(tmp_path / "paused"))
        time.sleep(1.0)
        assert len(metrics(tmp_path / "paused")) == held <= 4  # at most the step in training finished
        operator.resume()
        operator.shutdown()
        thread.join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    paused, whole = metrics(tmp_path / "paused"), metrics(tmp_path / "whole")
    for record in paused + whole:
        record.pop("weight_version")  # the server's numbering goes on from one run to the next
    assert paused == whole
    assert_same_lora(tmp_path / "paused" / "lora", tmp_path / "whole" / "lora")


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_the_asynchronous_run_on_mp_and_ray_is_the_in_process_run(tiny_model, tmp_path, executor):
    """The rollout thread drives a worker in another process (mp) or a Ray actor the same way: the
    same staleness, weight versions, rewards and LoRA as with 'uni', to float32 rounding (the
    worker's GEMMs may run on other threads; bitwise equality is the uni runs' above)."""
    option = "asynchronous.max_staleness=1"
    in_process = train(tiny_model, tmp_path / "uni", "steps=3", option)
    elsewhere = train(tiny_model, tmp_path / executor, "steps=3", option, f"engine.executor={executor}")
    records, expected = metrics(tmp_path / executor), metrics(tmp_path / "uni")
    for key in ("sample_staleness", "weight_version"):
        assert [r[key] for r in records] == [r[key] for r in expected]
    for key in ("reward_mean", "loss"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in expected], rel=1e-4, abs=1e-6)
    assert elsewhere["eval_reward_end"] == pytest.approx(in_process["eval_reward_end"], rel=1e-4, abs=1e-6)
    assert_same_lora(tmp_path / executor / "lora", tmp_path / "uni" / "lora", rtol=1e-4, atol=1e-6)
