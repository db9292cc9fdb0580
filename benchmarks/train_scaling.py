"""Data-parallel GRPO on the tiny SD3: the step time and its split for 1 and 2 trainer ranks,
colocated and separate, launched as users launch them.

Each case runs recipes/configs/grpo_tiny.yaml, sized down (--steps, --prompts-per-step,
--num-samples; a one-image eval), in a fresh process tree: 1 rank as `python -m recipes.run CONFIG`,
2 ranks as `python -m torch.distributed.run --standalone --nproc-per-node 2 -m recipes.run CONFIG`,
with OMP_NUM_THREADS set to the case's threads per rank.

  colocated   trainer.placement=colocated: every rank hosts an in-process `uni` engine (sharing
              the base with its policy), samples and rewards its share of the step's prompts.
  separate    trainer.placement=separate, engine.executor=mp with one worker process: rank 0 drives
              it, samples the whole step and hands each rank its share; every rank trains.

Threads. --threads T is what the run may use (default 2: this machine's cores): a case "2x1" is 2
ranks of 1 thread each. "1xT" (one rank on all T) is the fair baseline of "2x(T/2)": the same
cores, one process or two. "1x(T/2)" is one rank as each of the 2 ranks runs, which shows how
the work divides apart from how threads scale. The separate engine's worker always has T threads:
the loop is synchronous, so it samples while the trainers wait, and waits while they train.

The split, read from each run's metrics.jsonl, medians over its steps after the first (the first
pays for first calls; `wall_s` counts from before the first eval): step (the time between two
steps' ends), sampling (rollout_s - reward_wait_s: the engine's samples, the slowest rank's when
colocated), reward wait (rewards still running after the last sample), share (trainer_wait_s -
rollout_s: the rollout's gather or scatter among the ranks, and waiting for a slower one), update
(forwards, backwards, the gradients' all-reduce, the optimizer), push (the new LoRA into the
engines) and other (logging and bookkeeping: the step less all of the above). Medians of the
parts need not add up to the median step. The speedups are 1 rank's time over 2 ranks', per round,
on the same machine: only the ratios carry to another CPU. The load average is noted before and
after, since other processes on the machine share its cores: on a loaded machine a process of 2
threads loses far more than one of 1 (OpenMP's threads spin at each barrier while the other waits
to be scheduled), so read the numbers beside it.

Check: every case learns the same thing (reward_mean per step within 1e-3 of the first case's:
the data-parallel contract, so the times compare equal work).

    python -m benchmarks.train_scaling                                  # the 6 cases, about 3 minutes
    python -m benchmarks.train_scaling --cases colocated-1x2 colocated-2x1 --repeats 3
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import harness

CONFIG = harness.ROOT / "recipes" / "configs" / "grpo_tiny.yaml"
PLACEMENTS = ("colocated", "separate")
PARTS = ("sampling_s", "reward_wait_s", "share_s", "update_s", "push_s", "other_s")
REWARD_ATOL = 1e-3  # the data-parallel contract's metric tolerance (tests/recipes/test_data_parallel_recipes.py)


@dataclass(frozen=True)
class Case:
    placement: str
    ranks: int
    threads: int  # per rank

    @property
    def name(self) -> str:
        return f"{self.placement}-{self.ranks}x{self.threads}"

    @classmethod
    def parse(cls, text: str) -> Case:
        """`colocated-2x1`: placement, ranks x threads per rank."""
        placement, _, shape = text.partition("-")
        ranks, _, threads = shape.partition("x")
        if placement not in PLACEMENTS or not ranks.isdigit() or not threads.isdigit() or int(ranks) not in (1, 2):
            raise ValueError(f"case {text!r}: expected PLACEMENT-RANKSxTHREADS, e.g. colocated-2x1 ({PLACEMENTS})")
        return cls(placement, int(ranks), int(threads))


def _case_name(text: str) -> str:  # checked here, kept as text (the report's header is JSON)
    return Case.parse(text).name


def default_cases(threads: int) -> list[Case]:
    half = max(1, threads // 2)
    cases = [Case(p, ranks, t) for p in PLACEMENTS for ranks, t in ((1, threads), (1, half), (2, half))]
    return list(dict.fromkeys(cases))  # one thread: 1x1 once


def build_parser():
    parser = harness.parser("train_scaling", __doc__, repeats=1, warmup=0, threads=2, model=None)
    run = parser.add_argument_group("what to run")
    run.add_argument("--cases", nargs="+", type=_case_name, help="PLACEMENT-RANKSxTHREADS (default: 6, see above)")
    run.add_argument("--steps", type=harness.positive_int, default=5, help="training steps per run (1st untimed)")
    run.add_argument("--prompts-per-step", type=harness.positive_int, default=4, help="prompts (groups) per step")
    run.add_argument("--num-samples", type=harness.positive_int, default=4, help="samples per prompt")
    harness.add_recipe_overrides(run, "every case")
    run.add_argument("--timeout-s", type=float, default=600.0, help="the longest one run may take")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3: the first step is not timed and a median needs steps after it")
    cases = [Case.parse(name) for name in args.cases] if args.cases else default_cases(args.threads)
    torch.set_num_threads(args.threads)  # the header's threads: what the cases share
    report = harness.Report("train_scaling", args, __doc__, argv)
    load_before = os.getloadavg()
    histories: dict[str, list[list[dict]]] = {case.name: [] for case in cases}
    with tempfile.TemporaryDirectory() as scratch:
        model = str(args.model) if args.model is not None else _tiny_model(Path(scratch) / "tiny")

        def mode(case: Case):
            def run(round_: harness.Round) -> dict[str, float]:
                history = _train(args, case, model, Path(scratch) / f"{case.name}-{round_.index}")
                histories[case.name].append(history)
                return step_split(history)

            return run

        samples = harness.run_rounds({case.name: mode(case) for case in cases}, args.warmup, args.repeats)
    load_after = os.getloadavg()
    return _report(report, args, cases, samples, histories, (load_before, load_after))


def _tiny_model(folder: Path) -> str:
    from rollout.pipelines.tiny import build_tiny_sd3

    return str(build_tiny_sd3(folder, seed=0))


def command(case: Case, overrides: list[str]) -> list[str]:
    """The launch a user types for `case`: recipes.run, under torchrun for 2 ranks."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.ranks}"]
    argv = [*(launcher if case.ranks > 1 else [sys.executable]), "-m", "recipes.run", str(CONFIG)]
    for override in overrides:
        argv += ["--set", override]
    return argv


def case_overrides(args, case: Case, model: str, out: Path) -> list[str]:
    engine = ["engine.executor=uni"]
    if case.placement == "separate":  # one worker process, on every core while the trainers wait
        engine = ["engine.executor=mp", "engine.num_workers=1", f"engine.threads_per_worker={args.threads}"]
    return [
        f"model.path={model}",
        f"output_dir={out}",
        f"steps={args.steps}",
        f"prompts_per_step={args.prompts_per_step}",
        f"sampling.num_samples={args.num_samples}",
        "eval.num_prompts=1",
        "eval.num_samples=1",
        "eval.num_inference_steps=1",
        "logger=[jsonl]",
        f"trainer.placement={case.placement}",
        *engine,
        *args.overrides,
    ]


def _train(args, case: Case, model: str, out: Path) -> list[dict]:
    """Run `case` to its end in a process group of its own (killed whole on a timeout or an
    interrupt, so nothing outlives the benchmark); returns its metrics.jsonl records."""
    argv = command(case, case_overrides(args, case, model, out))
    env = {**os.environ, "OMP_NUM_THREADS": str(case.threads), "PYTHONPATH": str(harness.ROOT)}
    out.mkdir(parents=True)
    log = out / "run.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            argv, cwd=harness.ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=args.timeout_s)
        except BaseException:  # a timeout, Ctrl-C: the ranks and the engine's workers go too
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    if returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"case {case.name}: `{' '.join(argv)}` exited with {returncode}; its log ends:\n{tail}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_split(history: list[dict]) -> dict[str, float]:
    """The median step time and parts (seconds) over a run's steps after the first (see the module's
    docstring for what each part holds)."""
    if len(history) < 3:
        raise ValueError(f"a run of {len(history)} steps: the split needs at least 3 (the first is not timed)")
    rows = []
    for earlier, record in zip(history, history[1:], strict=False):
        step_s = record["wall_s"] - earlier["wall_s"]
        waited, trained, pushed = record["trainer_wait_s"], record["update_s"], record["push_s"]
        rows.append(
            {
                "step_s": step_s,
                "sampling_s": record["rollout_s"] - record["reward_wait_s"],
                "reward_wait_s": record["reward_wait_s"],
                "share_s": waited - record["rollout_s"],
                "update_s": trained,
                "push_s": pushed,
                "other_s": step_s - waited - trained - pushed,
            }
        )
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def _report(report, args, cases, samples, histories, loads) -> dict:
    rows = []
    for case in cases:
        measured = samples[case.name]
        rows.append(
            [
                case.name,
                case.ranks,
                case.threads,
                statistics.median(measured["step_s"]),
                *(statistics.median(measured[part]) for part in PARTS),
            ]
        )
    report.table(
        f"GRPO on the tiny SD3: seconds per step ({args.prompts_per_step} prompts x {args.num_samples} samples, "
        f"median over steps 2..{args.steps} and {args.repeats} round(s))",
        ["case", "ranks", "threads/rank", "step", "sampling", "reward wait", "share", "update", "push", "other"],
        rows,
        note="colocated: a uni engine in every rank; separate: rank 0 drives one mp worker "
        f"({args.threads} threads). share: the rollout's gather or scatter among the ranks.",
    )
    by_name = {case.name: case for case in cases}
    speedups, ratio_rows = {}, []
    for case in cases:
        if case.ranks != 2:
            continue
        for baseline in (Case(case.placement, 1, 2 * case.threads), Case(case.placement, 1, case.threads)):
            if baseline.name not in by_name:
                continue
            ratios = {
                key: harness.per_round_ratio(samples[baseline.name][key], samples[case.name][key])
                for key in ("step_s", "sampling_s", "update_s")
            }
            speedups[f"{case.name} over {baseline.name}"] = ratios
            ratio_rows.append([case.name, baseline.name, ratios["step_s"], ratios["sampling_s"], ratios["update_s"]])
    if ratio_rows:
        report.table(
            "2 ranks over 1: speedup (1 rank's seconds / 2 ranks', median over rounds)",
            ["2 ranks", "over 1 rank", "step", "sampling", "update"],
            ratio_rows,
            note="Ratios of this CPU only: on GPUs each rank has a device of its own.",
        )
    (before, after) = loads
    report.note(
        f"load average (1, 5, 15 min) before: {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}, "
        f"after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}, on {os.cpu_count()} cores"
    )
    first = cases[0].name
    reference = [record["reward_mean"] for record in histories[first][0]]
    drift = max(
        abs(record["reward_mean"] - expected)
        for runs in histories.values()
        for history in runs
        for record, expected in zip(history, reference, strict=True)
    )
    report.check(harness.Target(f"largest |reward_mean - {first}'s| over steps", drift, "<=", REWARD_ATOL))
    report.results = {
        "cases": {
            case.name: {"placement": case.placement, "ranks": case.ranks, "threads": case.threads} | samples[case.name]
            for case in cases
        },
        "speedups": speedups,
        "load_average": {"before": list(before), "after": list(after)},
        "reward_mean": {name: [[r["reward_mean"] for r in h] for h in runs] for name, runs in histories.items()},
    }
    return report.finish()


if __name__ == "__main__":
    main()
