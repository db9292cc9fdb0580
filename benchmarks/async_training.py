"""Asynchronous GRPO against the synchronous loop: the step's wall time and the learning curve,
side by side, on the tiny SD3 recipe (recipes/configs/grpo_async_tiny.yaml).

Each seed runs the recipe twice, in a rotated order: `sync` (asynchronous.max_staleness null: sample,
reward, then train, in turn) and `async` (max_staleness N: the next steps sample while this one
trains). The engine runs in a worker process (`mp`) and every process computes on `--threads`
threads (1 by default), so on a 2-core machine the engine and the trainer each have a core, as they
would each have their GPUs. The recipe is sized so that a rollout and an update cost about the same.

Step time: the median over a run's steps (after the first two) of the wall time between two steps'
ends. Target: async / sync <= 0.65 (the median over seeds of each seed's ratio). Learning: the
mean reward of the last 5 updates, per seed; the asynchronous runs' mean must lie within the
synchronous seeds' [min, max] (their seed-to-seed spread). The staleness histogram counts the
asynchronous runs' samples by how many versions older than the trainer's policy they were.

The contract check: every asynchronous step re-scores its stale samples with the adapters that
sampled them (`behaviour_rescore_s`, part of the update) and holds them to
`max_log_ratio_before_update`; reported per seed as the median over steps (after the first two) of
its seconds, and that over the run's median step time and median update time, with the largest
`log_ratio_before_update` the run logged (target: below the contract's 1e-5).

    python -m benchmarks.async_training                       # 3 seeds, 30 steps, N = 1
    python -m benchmarks.async_training --seeds 2 --steps 12 --plot async.png --json out.json
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks import harness
from recipes.plots import plot_runs
from rollout.rescoring import RATIO_TOLERANCE

CONFIG = harness.ROOT / "recipes" / "configs" / "grpo_async_tiny.yaml"
TARGET_STEP_RATIO = 0.65
WINDOW = 5  # updates averaged at the end of a run
MODES = ("sync", "async")


def build_parser():
    parser = harness.parser("async_training", __doc__, threads=1)
    run = parser.add_argument_group("what to run")
    run.add_argument("--seeds", type=harness.positive_int, default=3, help="training runs per mode (seeds 0..)")
    run.add_argument("--steps", type=harness.positive_int, default=30, help="training steps per run")
    run.add_argument("--max-staleness", type=harness.positive_int, default=1, help="N of the asynchronous runs")
    run.add_argument("--executor", choices=("mp", "uni"), default="mp", help="where the engine runs")
    harness.add_recipe_overrides(run, "both modes")
    run.add_argument("--plot", type=Path, metavar="PATH", help="write reward against update and wall time as a PNG")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # Before any worker starts: spawned workers read it when they import torch.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    report = harness.Report("async_training", args, __doc__, argv)
    histories: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in range(args.seeds):
            order = MODES if seed % 2 == 0 else MODES[::-1]
            for mode in order:
                histories[mode].append(_train(args, mode, seed, Path(scratch) / f"{mode}{seed}"))
    return _report(report, args, histories)


def _train(args, mode: str, seed: int, out: Path) -> list[dict]:
    from recipes.grpo import run
    from recipes.loading import load_config

    staleness = "null" if mode == "sync" else str(args.max_staleness)
    overrides = [
        f"seed={seed}",
        f"steps={args.steps}",
        f"output_dir={out}",
        f"engine.executor={args.executor}",
        f"engine.threads_per_worker={args.threads}",
        f"asynchronous.max_staleness={staleness}",
        "eval.num_prompts=1",
        "eval.num_samples=1",
        "eval.num_inference_steps=1",
        *args.overrides,
    ]
    run(load_config(CONFIG, overrides))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _step_s(history: list[dict]) -> float:
    ends = [record["wall_s"] for record in history]
    return statistics.median(later - earlier for earlier, later in zip(ends[1:], ends[2:], strict=False))


def _report(report: harness.Report, args, histories: dict[str, list[list[dict]]]) -> dict:
    step_s = {mode: [_step_s(history) for history in histories[mode]] for mode in MODES}
    final = {
        mode: [statistics.fmean(r["reward_mean"] for r in history[-WINDOW:]) for history in histories[mode]]
        for mode in MODES
    }
    ratio = harness.per_round_ratio(step_s["async"], step_s["sync"])
    rows = []
    for mode in MODES:
        parts = {
            key: statistics.median(statistics.median(r[key] for r in h[2:]) for h in histories[mode])
            for key in ("rollout_s", "update_s", "trainer_wait_s")
        }
        rows.append(
            [mode, statistics.median(step_s[mode]), parts["rollout_s"], parts["update_s"], parts["trainer_wait_s"]]
        )
    report.table(
        f"{args.seeds} seeds x {args.steps} steps, tiny SD3 ({args.executor}, {args.threads} thread(s) per process), "
        f"asynchronous max_staleness {args.max_staleness}",
        ["mode", "median step s", "rollout s", "update s", "trainer waits s"],
        rows,
        note=f"async / sync step time: {ratio:.3f} (median over seeds of each seed's ratio)",
    )
    sync_low, sync_high = min(final["sync"]), max(final["sync"])
    async_mean = statistics.fmean(final["async"])
    report.table(
        f"reward of the last {WINDOW} updates, per seed",
        ["mode", *[f"seed {seed}" for seed in range(args.seeds)], "mean"],
        [[mode, *final[mode], statistics.fmean(final[mode])] for mode in MODES],
        note=f"synchronous spread [{sync_low:.4f}, {sync_high:.4f}]; asynchronous mean {async_mean:.4f}",
    )
    curve_rows = []
    for step in range(args.steps):
        curve_rows.append(
            [step, *(statistics.fmean(h[step]["reward_mean"] for h in histories[mode]) for mode in MODES)]
        )
    report.table("mean reward per update (over seeds)", ["update", *MODES], curve_rows)
    histogram: dict[str, int] = {}
    for history in histories["async"]:
        for record in history:
            for age, count in record["sample_staleness"].items():
                histogram[age] = histogram.get(age, 0) + count
    report.table(
        "asynchronous samples by staleness (versions behind the trainer's policy)",
        ["versions", "samples"],
        [[age, count] for age, count in sorted(histogram.items(), key=lambda item: int(item[0]))],
    )
    weights = [r["importance_weight_std"] for h in histories["async"] for r in h[1:]]
    report.note(
        f"importance weights' spread (std within a step), median over async steps: {statistics.median(weights):.2e}"
    )
    check = _contract_check(report, histories["async"], step_s["async"])
    report.results = {
        "step_s": step_s,
        "step_ratio": ratio,
        "final_reward": final,
        "staleness": histogram,
        "curves": {mode: [[r["reward_mean"] for r in h] for h in histories[mode]] for mode in MODES},
        "wall_s": {mode: [[r["wall_s"] for r in h] for h in histories[mode]] for mode in MODES},
        "contract_check": check,
    }
    report.check(harness.Target("async / sync step time", ratio, "<=", TARGET_STEP_RATIO))
    report.check(harness.Target("async mean final reward - sync min", async_mean - sync_low, ">=", 0.0))
    report.check(harness.Target("async mean final reward - sync max", async_mean - sync_high, "<=", 0.0))
    worst = max(check["log_ratio_max"])
    report.check(harness.Target("async max log_ratio_before_update", worst, "<", RATIO_TOLERANCE))
    if args.plot is not None:
        plot_runs(histories, args.plot, "asynchronous vs synchronous GRPO on the tiny SD3 (one line per seed)")
        report.note(f"plot: {args.plot}")
    return report.finish()


def _contract_check(report: harness.Report, histories: list[list[dict]], step_s: list[float]) -> dict:
    """The per-step re-scoring check of the asynchronous runs: its seconds per step, its share of the
    step and of the update, and the largest |log ratio| it found, per seed."""
    check_s = [statistics.median(r["behaviour_rescore_s"] for r in h[2:]) for h in histories]
    update_s = [statistics.median(r["update_s"] for r in h[2:]) for h in histories]
    log_ratio_max = [max(r["log_ratio_before_update"] for r in h) for h in histories]
    rows = [
        [seed, check_s[seed], f"{check_s[seed] / step_s[seed]:.1%}", f"{check_s[seed] / update_s[seed]:.1%}", worst]
        for seed, worst in enumerate(log_ratio_max)
    ]
    report.table(
        "the per-step contract check of the asynchronous runs (stale samples re-scored by the adapters that sampled "
        "them)",
        ["seed", "check s per step", "of the step", "of the update", "max log_ratio_before_update"],
        rows,
        note=f"median over seeds: {statistics.median(check_s):.4f} s per step, "
        f"{statistics.median(c / s for c, s in zip(check_s, step_s, strict=True)):.1%} of the step time",
    )
    return {
        "check_s": check_s,
        "fraction_of_step": [c / s for c, s in zip(check_s, step_s, strict=True)],
        "fraction_of_update": [c / u for c, u in zip(check_s, update_s, strict=True)],
        "log_ratio_max": log_ratio_max,
    }


if __name__ == "__main__":
    main()
