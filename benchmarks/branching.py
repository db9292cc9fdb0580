"""Branching: transformer forwards and wall time per leaf of flat GRPO, Flow-GRPO-Fast and a depth-2 tree.

On the tiny SD3 pipeline (random weights; `--model` names another SD3 folder) and one uni
`RolloutEngine`, samples the rollout shapes of the tiny recipes, each from its YAML's `sampling:`
section (only the seed set per round, no LoRA): 8 leaves per prompt, 8 steps, flow_sde, noise
level 0.7, guidance 1. In recipes/configs/:

  flat   grpo_tiny.yaml: 8 independent samples per prompt, every step stochastic;
  tree   branch_grpo_tiny.yaml: 2 roots, every path splits in 2 before steps 2 and 4 (BranchGRPO);
  fast   grpo_fast_tiny.yaml: 1 root, an ODE prefix over steps 0-4, split in 8 before step 5, SDE
         window [5, 7) (Flow-GRPO-Fast).

Per leaf: the rows through the transformer (`StepReport.transformer_rows`; expected flat 8, tree
(2*2 + 4*2 + 8*4) / 8 = 5.5, fast 5/8 + 3 = 3.625; target: fast <= 0.5x flat), and the wall time
of `engine.generate` of `--prompts` prompts, split into the transformer's forwards
(`transformer_s`) and the rest (encoding, sampler, history, decode, trajectories). Target: fast's
wall ratio to flat lies within 15% of its forwards ratio; the tiny model sits near that bound, as
the work outside the transformer is about the same per leaf for every shape. Unless
`--skip-training`, each recipe also trains for `--train-steps` steps per seed: reward margin (mean
reward of the last 5 steps - of the first 5), minutes (`train_s`), margin per minute, and |log
ratio| before the first update.

With `--max-batch-size` 64 a generate is one batch per step for every shape: flat runs 32 rows per
forward, fast's prefix 4, and a row need not cost the same in both (the transformer-time ratio
shows how far). Rounds are interleaved (seed = round index). `--threads` is 1: more torch threads
than idle cores make every op wait for descheduled threads, and small forwards' times noise.

    python -m benchmarks.branching                  # about 1 minute on 2 CPU cores (35-40 s training)
    python -m benchmarks.branching --skip-training --repeats 9 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.harness import Stats, Target, positive_int
from recipes.loading import load_config, recipe_module
from rollout import EngineConfig, RolloutEngine, RolloutOutput, SamplingParams
from rollout.pipelines.tiny import build_tiny_sd3

CONFIGS = Path(__file__).resolve().parent.parent / "recipes" / "configs"
# shape -> (recipe YAML, label)
SHAPES = {
    "flat": ("grpo_tiny.yaml", "flat GRPO"),
    "tree": ("branch_grpo_tiny.yaml", "depth-2 tree (BranchGRPO)"),
    "fast": ("grpo_fast_tiny.yaml", "Flow-GRPO-Fast"),
}
TARGET_FORWARDS_RATIO = 0.5  # the project's target: fast forwards per leaf over flat's
FOLLOW_TOLERANCE = 0.15  # wall ratio "follows the forwards": within 15% of the forwards ratio
MARGIN_WINDOW = 5  # the recipes' summary averages the first and the last 5 steps' rewards


def seed_list(text: str) -> list[int]:
    seeds = [int(part) for part in text.split(",") if part.strip()]  # argparse reports a ValueError
    if not seeds:
        raise argparse.ArgumentTypeError("give at least one seed")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    parser = harness.parser("branching", __doc__, repeats=5, warmup=1, threads=1, model=None)
    run = parser.add_argument_group("rollouts")
    run.add_argument("--prompts", type=positive_int, default=4, help="prompts per generate (each gives 8 leaves)")
    run.add_argument("--max-batch-size", type=positive_int, default=64, help="the engine's max_batch_size")
    train = parser.add_argument_group("training")
    train.add_argument("--skip-training", action="store_true", help="only the rollouts: run no recipe")
    steps_help = f"steps per recipe run (under {2 * MARGIN_WINDOW} the margin's windows overlap)"
    train.add_argument("--train-steps", type=positive_int, default=15, help=steps_help)
    train.add_argument("--train-seeds", type=seed_list, default="0", help="comma-separated seeds, one run each")
    train.add_argument("--train-prompts-per-step", type=positive_int, default=2, help="the recipes' prompts_per_step")
    return parser


def leaves_per_prompt(params: SamplingParams) -> int:
    return params.num_samples * params.leaves_per_sample


def expected_rows_per_leaf(params: SamplingParams) -> float:
    """Transformer rows a prompt needs (every path that exists at a step runs that step once; a path
    splits before each branch step) over the prompt's leaves."""
    steps = range(params.num_inference_steps)
    paths = sum(params.branch_factor ** sum(b <= step for b in params.branch_steps) for step in steps)
    return params.num_samples * paths / leaves_per_prompt(params)


def describe(params: SamplingParams) -> str:
    split = f"split x{params.branch_factor} before {list(params.branch_steps)}" if params.branch_steps else "no split"
    window = list(params.sde_window) if params.sde_window is not None else "all"
    return f"roots {params.num_samples}, {split}, sde {window}"


# Rollouts.


def check_outputs(shape: str, outputs: list[RolloutOutput], params: SamplingParams, prompts: list[str]) -> int:
    """The number of leaves; raises unless every prompt gave its leaves, all finished, with distinct paths."""
    expected = len(prompts) * leaves_per_prompt(params)
    problems = []
    if len(outputs) != expected:
        problems.append(f"{len(outputs)} outputs, expected {expected}")
    if any(o.status != "finished" for o in outputs):
        problems.append(f"statuses {sorted({o.status for o in outputs})}")
    if any(len(o.branch_path) != len(params.branch_steps) for o in outputs):
        problems.append(f"branch paths of lengths {sorted({len(o.branch_path) for o in outputs})}")
    if len({o.node_id for o in outputs}) != len(outputs):
        problems.append("repeated output ids (group, sample, branch path)")
    if problems:
        raise AssertionError(f"{shape}: wrong outputs: {'; '.join(problems)}")
    return len(outputs)


def time_shapes(engine: RolloutEngine, prompts: list[str], params: dict[str, SamplingParams], args) -> tuple:
    """Per shape and measurement, the timed rounds' values (seconds, leaves, rows, forward steps,
    transformer seconds, from the engine's StepReports), and per shape each timed round's rows per step."""
    rows_per_step: dict[str, list[list[int]]] = {shape: [] for shape in params}

    def run(shape: str, round_: harness.Round) -> dict:
        round_params = dataclasses.replace(params[shape], seed=round_.index)
        reports.clear()
        outputs, elapsed = harness.timed_call(engine.generate, prompts, round_params)
        steps = [r for r in reports if r.kind == "step"]
        rows = [sum(r.transformer_rows) for r in steps if sum(r.transformer_rows)]
        if round_.timed:
            rows_per_step[shape].append(rows)
        leaves = check_outputs(shape, outputs, round_params, prompts)
        tf_s = sum(sum(r.transformer_s) for r in steps)
        return {"s": elapsed, "leaves": leaves, "rows": sum(rows), "forward_steps": len(rows), "transformer_s": tf_s}

    with harness.step_reports(engine) as reports:
        modes = {shape: functools.partial(run, shape) for shape in params}
        samples = harness.run_rounds(modes, args.warmup, args.repeats)
    return samples, rows_per_step


def summarize_rollouts(samples: dict, rows_per_step: dict, params: dict, report: harness.Report) -> dict:
    def per_leaf(shape: str, name: str) -> list[float]:
        return [v / leaves for v, leaves in zip(samples[shape][name], samples[shape]["leaves"], strict=True)]

    summary = {}
    for shape, measured in samples.items():
        wall, transformer = per_leaf(shape, "s"), per_leaf(shape, "transformer_s")
        summary[shape] = {
            "sampling": describe(params[shape]),
            "leaves": int(measured["leaves"][0]),
            "forward_steps": sorted(set(measured["forward_steps"])),
            "rows": sorted(set(measured["rows"])),  # one value unless the engine's work varies by seed
            "rows_per_step": rows_per_step[shape],
            "rows_per_leaf": statistics.median(per_leaf(shape, "rows")),
            "expected_rows_per_leaf": expected_rows_per_leaf(params[shape]),
            "ms_per_leaf": Stats.of(wall, 1e3),
            "transformer_ms_per_leaf": Stats.of(transformer, 1e3).median,
            "other_ms_per_leaf": Stats.of([w - t for w, t in zip(wall, transformer, strict=True)], 1e3).median,
            "rounds": measured,
        }
    for shape, row in summary.items():
        row["forwards_vs_flat"] = row["rows_per_leaf"] / summary["flat"]["rows_per_leaf"]
        row["wall_vs_flat"] = harness.per_round_ratio(per_leaf(shape, "s"), per_leaf("flat", "s"))
        tf, tf_flat = per_leaf(shape, "transformer_s"), per_leaf("flat", "transformer_s")
        row["transformer_vs_flat"] = harness.per_round_ratio(tf, tf_flat)
        row["wall_over_forwards_ratio"] = row["wall_vs_flat"] / row["forwards_vs_flat"]
    report.results["rollouts"] = summary

    report.table(
        "rollouts per leaf (medians; ratios to flat: medians of per-round ratios)",
        ["shape", "sampling", "forward steps", "rows/leaf", "expected", "x flat", "ms/leaf", "min", "max", "x flat"]
        + ["tf ms/leaf", "x flat", "other ms"],
        [
            [label, row["sampling"], "/".join(str(c) for c in row["forward_steps"]), row["rows_per_leaf"]]
            + [row["expected_rows_per_leaf"], row["forwards_vs_flat"], row["ms_per_leaf"].median]
            + [row["ms_per_leaf"].min, row["ms_per_leaf"].max, row["wall_vs_flat"], row["transformer_ms_per_leaf"]]
            + [row["transformer_vs_flat"], row["other_ms_per_leaf"]]
            for row, (_, label) in zip(summary.values(), SHAPES.values(), strict=True)
        ],
        note="forward steps: engine steps that ran the transformer per generate (StepReport.transformer_rows > 0;\n"
        "one forward each while a step is one batch); rows/leaf: their rows over the leaves; ms/leaf: generate's\n"
        "wall time over its leaves; tf: the part inside the transformer's forwards (StepReport.transformer_s);\n"
        "other: the rest (encode, sampler, history, decode, trajectories)",
    )
    report.table(
        f"wall follows forwards (wall ratio within {100 * FOLLOW_TOLERANCE:.0f}% of the forwards ratio)",
        ["shape", "wall x flat", "forwards x flat", "wall/forwards"],
        [
            [SHAPES[shape][1], row["wall_vs_flat"], row["forwards_vs_flat"], row["wall_over_forwards_ratio"]]
            for shape, row in summary.items()
            if shape != "flat"
        ],
        note="the target is on Flow-GRPO-Fast; the tree's is shown without one",
    )
    for shape, (_, label) in SHAPES.items():
        rows = summary[shape]["rows"]
        if len(rows) != 1:
            report.note(f"{label}: rows per generate differ between rounds: {rows}")
        value = summary[shape]["rows_per_leaf"] if len(rows) == 1 else float("nan")
        report.check(Target(f"{label} rows/leaf == expected", value, "==", summary[shape]["expected_rows_per_leaf"]))
    fast = summary["fast"]
    report.check(Target("Flow-GRPO-Fast forwards/leaf x flat", fast["forwards_vs_flat"], "<=", TARGET_FORWARDS_RATIO))
    report.check(
        Target("Flow-GRPO-Fast |wall/forwards - 1|", abs(fast["wall_over_forwards_ratio"] - 1), "<=", FOLLOW_TOLERANCE)
    )
    return summary


def measure_rollouts(model: Path, args, report: harness.Report) -> None:
    configs = {shape: load_config(CONFIGS / file) for shape, (file, _) in SHAPES.items()}
    params = {shape: config.sampling for shape, config in configs.items()}
    sizes = {shape: (leaves_per_prompt(p), p.num_inference_steps) for shape, p in params.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the recipes' shapes differ in (leaves per prompt, steps): {sizes}; compare like with like")
    prompts = [configs["flat"].prompts[i % len(configs["flat"].prompts)] for i in range(args.prompts)]
    report.note(
        f"rollouts: {args.prompts} prompts x 8 leaves per generate, 8 steps, max batch {args.max_batch_size}, "
        f"{args.threads} threads; {args.warmup} warmup + {args.repeats} timed rounds"
    )
    with RolloutEngine(EngineConfig(model=str(model), executor="uni", max_batch_size=args.max_batch_size)) as engine:
        samples, rows_per_step = time_shapes(engine, prompts, params, args)
    summarize_rollouts(samples, rows_per_step, params, report)


# Training.


def train_recipes(model: Path, folder: Path, args) -> dict[str, list[dict]]:
    """Per recipe, one record per seed: the summary's numbers, or the error that stopped the run."""
    results: dict[str, list[dict]] = {shape: [] for shape in SHAPES}
    for seed in args.train_seeds:
        for shape, (file, label) in SHAPES.items():
            overrides = [f"model.path={model}", f"output_dir={folder / f'{shape}-seed{seed}'}", f"seed={seed}"]
            overrides += [f"steps={args.train_steps}", f"prompts_per_step={args.train_prompts_per_step}"]
            overrides += ["eval.num_prompts=1", "eval.num_samples=1", "eval.num_inference_steps=2"]
            print(f"training {label} ({file}), seed {seed}, {args.train_steps} steps", flush=True)
            try:
                config = load_config(CONFIGS / file, overrides)
                summary = recipe_module(config.recipe).run(config)
            except Exception as error:  # reported in the table; the other recipes still run
                logging.getLogger("benchmarks.branching").exception(f"{label}, seed {seed}: the recipe failed")
                results[shape].append({"seed": seed, "error": f"{type(error).__name__}: {error}"})
                continue
            keys = ("steps", "train_s", "reward_first5", "reward_last5", "reward_margin")
            record = {"seed": seed} | {key: summary[key] for key in keys}
            record["margin_per_minute"] = summary["reward_margin"] / (summary["train_s"] / 60)
            record["log_ratio_before_first_update"] = summary["log_ratio_before_first_update"]
            results[shape].append(record)
            print(f"  {shape}: margin {record['reward_margin']:+.4f} ({record['margin_per_minute']:+.4f}/min)")
    return results


def report_training(training: dict[str, list[dict]], args, report: harness.Report) -> None:
    report.results["training"] = training
    signed = "{:+.4f}".format  # the margins
    rows = []
    for shape, (_, label) in SHAPES.items():
        for r in training[shape]:
            if "error" in r:
                rows.append([label, r["seed"], f"FAILED: {r['error']}"] + ["-"] * 5)
                continue
            log_ratio = r["log_ratio_before_first_update"]
            log_ratio = "-" if log_ratio is None else f"{log_ratio:.1e}"
            margins = [signed(r["reward_margin"]), r["train_s"] / 60, signed(r["margin_per_minute"])]
            rows.append([label, r["seed"], r["reward_first5"], r["reward_last5"], *margins, log_ratio])
        done = [r for r in training[shape] if "error" not in r]
        if len(args.train_seeds) > 1 and done:
            mean = {k: statistics.mean(r[k] for r in done) for k in ("reward_margin", "train_s", "margin_per_minute")}
            margins = [signed(mean["reward_margin"]), mean["train_s"] / 60, signed(mean["margin_per_minute"])]
            rows.append(["  mean", "", "", "", *margins, ""])
    report.table(
        f"training: {args.train_steps} steps x {args.train_prompts_per_step} prompts x 8 leaves, "
        f"seeds {args.train_seeds}",
        ["recipe", "seed", "first5", "last5", "margin", "minutes", "margin/min", "|log ratio| before 1st update"],
        rows,
        note=f"margin = mean reward of the last {MARGIN_WINDOW} steps - of the first {MARGIN_WINDOW}; minutes = the "
        "recipe's train_s (engine start, evals, rollouts, updates, pushes)",
    )


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # the engine and the recipes: quiet
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the uni worker and the recipes' trainers run in this process
    report = harness.Report("branching", args, __doc__, argv)
    start, load = time.perf_counter(), os.getloadavg()[0]
    report.results["targets"] = {
        "fast_forwards_vs_flat_max": TARGET_FORWARDS_RATIO,
        "wall_follow_tolerance": FOLLOW_TOLERANCE,
    }
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-branching-") as tmp:
            model = args.model or build_tiny_sd3(Path(tmp) / "tiny", seed=0)
            measure_rollouts(model, args, report)
            if not args.skip_training:
                report_training(train_recipes(model, Path(tmp) / "runs", args), args, report)
    finally:
        torch.set_num_threads(previous_threads)
    report.results["total_s"] = total = time.perf_counter() - start
    report.note(f"total {total:.1f} s; load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} now")
    return report.finish()


if __name__ == "__main__":
    main()
