"""Branching: transformer forwards and wall time per leaf of flat GRPO, Flow-GRPO-Fast and a depth-2 tree.

Builds the tiny SD3 pipeline (random weights, in a temporary folder unless `--model` names an SD3
folder) and samples, on one `RolloutEngine` (executor uni, `--max-batch-size`), the three rollout
shapes of the tiny recipes, each from the `sampling:` section of its YAML (so the benchmark follows
the recipes; only the seed is set per round, no LoRA): 8 leaves per prompt and 8 steps each,
flow_sde, noise level 0.7, guidance 1 (no CFG pass):

  flat   recipes/configs/grpo_tiny.yaml: 8 independent samples per prompt, every step stochastic;
  tree   recipes/configs/branch_grpo_tiny.yaml: 2 roots per prompt, every path splits in 2 before
         steps 2 and 4 (BranchGRPO's depth-2 tree);
  fast   recipes/configs/grpo_fast_tiny.yaml: 1 root per prompt, an ODE prefix over steps 0-4, split
         in 8 before step 5, SDE window [5, 7) (Flow-GRPO-Fast).

and measures:

  forwards per leaf   the rows of every transformer forward (`latents.shape[0]` of each
                      `adapter.run_transformer` call, counted on the worker by a wrapper installed
                      through `collective_rpc`), over the leaves the generate returned. Expected from
                      the shapes: flat 8, tree (2*2 + 4*2 + 8*4) / 8 = 5.5, fast 5/8 + 3 = 3.625.
                      Target: fast <= 0.5x flat;
  wall per leaf       `engine.generate(prompts, params)` of `--prompts` prompts, timed, over its
                      leaves; next to it the seconds inside `run_transformer` per leaf and the rest
                      (prompt encoding, sampler, history, VAE decode of every leaf, trajectories).
                      Target: the fast shape's wall ratio to flat "follows the forwards", i.e. lies
                      within 15% of its forwards ratio (tree's is shown too, without a target). On
                      the tiny model it sits near that bound: the transformer time follows the rows
                      (0.45x), but the work outside it (decode, trajectories) is about the same per
                      leaf for every shape, and wall/forwards measured 1.13-1.41 over four runs on a
                      2-core machine that other jobs kept busy (1.13 with `--repeats 15`);
  training            unless `--skip-training`, each recipe run for `--train-steps` steps per seed
                      of `--train-seeds` (`--train-prompts-per-step` prompts per step, a 1-image
                      eval) on the same model folder: reward margin (mean reward of the last 5 steps
                      - of the first 5), minutes (the recipe's `train_s`: engine start, evals,
                      rollouts, updates and pushes), margin per minute, and the policy's |log ratio|
                      before its first update.

With the default `--max-batch-size` 64 a whole generate is one batch per step for every shape, so
the flat shape runs 32 rows per forward while the fast shape's prefix runs 4 (one per prompt): a
row need not cost the same in both, and that is the honest comparison (what the engine does with
these recipes); the transformer-time ratio next to the rows ratio shows how far they differ. Rounds
are interleaved (each runs every shape, in a rotated order, with seed = round index), warmup rounds
are discarded and medians are reported; ratios to flat are medians of per-round ratios. `--threads`
sets torch's threads (1 by default, as in `benchmarks.serve_load` and `benchmarks.weight_sync`: a
torch with more threads than idle cores waits for descheduled threads at every op, which on a busy
2-core machine turns small forwards' times, and so the ratios, into noise). (Past the ~400-line
guide: the rollouts, the forward counter, the training runs and the report share the recipes'
shapes, and a benchmark reads best as one script.)

    python -m benchmarks.branching                  # about 1 minute on 2 CPU cores (35-40 s training)
    python -m benchmarks.branching --skip-training --repeats 9 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import interleaved_rounds, json_args, per_round_ratio, spread, timed_call, write_json
from recipes.config import RecipeConfig, load_config, recipe_module
from rollout import EngineConfig, RolloutEngine, RolloutOutput, SamplingParams
from rollout.pipelines.tiny import build_tiny_sd3

logger = logging.getLogger("benchmarks.branching")
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
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not seeds:
        raise argparse.ArgumentTypeError("give at least one seed")
    return seeds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.branching",
        description=__doc__.split("\n\n")[0]
        + " Prints transformer rows per leaf (measured and expected), ms per leaf and the ratios to flat"
        " sampling with PASS/FAIL lines for the targets, and the recipes' reward margin per minute of training.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = parser.add_argument_group("rollouts")
    run.add_argument("--model", type=Path, help="SD3 pipeline folder (default: build tiny SD3 in a temporary folder)")
    run.add_argument("--prompts", type=int, default=4, help="prompts per generate (each gives 8 leaves)")
    run.add_argument(
        "--max-batch-size",
        type=int,
        default=64,
        help="the engine's max_batch_size; 64 fits a whole generate of 4 prompts into one batch per step",
    )
    run.add_argument("--threads", type=int, default=1, help="torch threads of this process (engine and training)")
    run.add_argument("--repeats", type=int, default=5, help="timed rounds; each runs every shape once")
    run.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    train = parser.add_argument_group("training")
    train.add_argument("--skip-training", action="store_true", help="only the rollouts: run no recipe")
    train.add_argument(
        "--train-steps",
        type=int,
        default=15,
        help=f"training steps of each recipe run (under {2 * MARGIN_WINDOW} the first and last "
        f"{MARGIN_WINDOW} steps overlap and the margin shrinks toward 0)",
    )
    train.add_argument(
        "--train-seeds", type=seed_list, default="0", help="comma-separated seeds; every recipe runs once per seed"
    )
    train.add_argument("--train-prompts-per-step", type=int, default=2, help="the recipes' prompts_per_step")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    positive = ("prompts", "max_batch_size", "threads", "repeats", "train_steps", "train_prompts_per_step")
    bad = [f"--{name.replace('_', '-')}" for name in positive if getattr(args, name) < 1]
    if bad or args.warmup < 0:
        parser.error(f"{', '.join(bad) or 'these options'} must be >= 1 (and --warmup >= 0)")
    return args


# The shapes.


def recipe_configs() -> dict[str, RecipeConfig]:
    return {shape: load_config(CONFIGS / file) for shape, (file, _) in SHAPES.items()}


def shape_params(configs: dict[str, RecipeConfig]) -> dict[str, SamplingParams]:
    """Each recipe's sampling section; raises unless all give the same leaves per prompt and steps."""
    params = {shape: config.sampling for shape, config in configs.items()}
    sizes = {shape: (p.num_samples * p.leaves_per_sample, p.num_inference_steps) for shape, p in params.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the recipes' shapes differ in (leaves per prompt, steps): {sizes}; compare like with like")
    return params


def leaves_per_prompt(params: SamplingParams) -> int:
    return params.num_samples * params.leaves_per_sample


def expected_rows_per_leaf(params: SamplingParams) -> float:
    """Transformer rows a prompt needs (every path that exists at a step runs that step once; a path
    splits before each branch step) over the prompt's leaves."""
    paths = [
        params.branch_factor ** sum(b <= step for b in params.branch_steps)
        for step in range(params.num_inference_steps)
    ]
    return params.num_samples * sum(paths) / leaves_per_prompt(params)


def describe(params: SamplingParams) -> str:
    branching = (
        f"split x{params.branch_factor} before {list(params.branch_steps)}" if params.branch_steps else "no split"
    )
    window = list(params.sde_window) if params.sde_window is not None else "all"
    return f"roots {params.num_samples}, {branching}, sde {window}"


# The forward counter: set on the worker through `collective_rpc` (it runs in the worker's thread
# or process), an instance attribute that shadows the adapter's `run_transformer` until removed.


def install_forward_counter(worker) -> None:
    """Record (rows, seconds) of every `run_transformer` call (CPU: no device to synchronize)."""
    adapter = worker.adapter
    if "run_transformer" in vars(adapter):
        raise RuntimeError("adapter.run_transformer is already shadowed on this worker")
    calls: list[tuple[int, float]] = []
    method = adapter.run_transformer

    def counted(latents, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(latents, *args, **kwargs)
        finally:
            calls.append((int(latents.shape[0]), time.perf_counter() - start))

    adapter.run_transformer = counted
    worker.benchmark_forwards = calls


def take_forwards(worker) -> list[tuple[int, float]]:
    """(rows, seconds) of every call since the last take."""
    taken = list(worker.benchmark_forwards)
    worker.benchmark_forwards.clear()
    return taken


def remove_forward_counter(worker) -> list[tuple[int, float]]:
    taken = take_forwards(worker)
    del worker.adapter.run_transformer
    del worker.benchmark_forwards
    return taken


# Rollouts.


def check_outputs(shape: str, outputs: list[RolloutOutput], params: SamplingParams, prompts: list[str]) -> int:
    """The number of leaves; raises unless every prompt gave its leaves, all finished, with distinct paths."""
    expected = len(prompts) * leaves_per_prompt(params)
    paths = {o.node_id for o in outputs}  # (group, sample, branch path)
    problems = []
    if len(outputs) != expected:
        problems.append(f"{len(outputs)} outputs, expected {expected}")
    if any(o.status != "finished" for o in outputs):
        problems.append(f"statuses {sorted({o.status for o in outputs})}")
    if any(len(o.branch_path) != len(params.branch_steps) for o in outputs):
        problems.append(f"branch paths of lengths {sorted({len(o.branch_path) for o in outputs})}")
    if len(paths) != len(outputs):
        problems.append("repeated output ids (group, sample, branch path)")
    if problems:
        raise AssertionError(f"{shape}: wrong outputs: {'; '.join(problems)}")
    return len(outputs)


def time_shapes(engine: RolloutEngine, prompts: list[str], params: dict[str, SamplingParams], args) -> dict:
    """Per shape, one record per timed round: seconds, leaves, forward calls, rows, transformer seconds."""
    records: dict[str, list[dict]] = {shape: [] for shape in params}
    engine.collective_rpc(install_forward_counter)
    try:
        for round_ in interleaved_rounds(params, args.warmup, args.repeats):
            for shape in round_.order:
                round_params = dataclasses.replace(params[shape], seed=round_.index)
                outputs, elapsed = timed_call(engine.generate, prompts, round_params)
                calls = engine.collective_rpc(take_forwards)[0]
                leaves = check_outputs(shape, outputs, round_params, prompts)
                rows = sum(r for r, _ in calls)
                logger.info(
                    f"  [{round_.tag}] {shape:<4} {elapsed:6.2f} s  {leaves} leaves  {len(calls)} forwards "
                    f"of {[r for r, _ in calls]} rows = {rows / leaves:.3f} rows/leaf"
                )
                if round_.timed:
                    records[shape].append(
                        {
                            "seconds": elapsed,
                            "leaves": leaves,
                            "forward_calls": len(calls),
                            "rows": rows,
                            "rows_per_call": [r for r, _ in calls],
                            "transformer_s": sum(s for _, s in calls),
                        }
                    )
    finally:
        engine.collective_rpc(remove_forward_counter)
    return records


def summarize_rollouts(records: dict[str, list[dict]], params: dict[str, SamplingParams]) -> dict:
    summary = {}
    for shape, rounds in records.items():
        leaves = rounds[0]["leaves"]
        rows = sorted({r["rows"] for r in rounds})  # one value unless the engine's work varies by seed
        per_leaf = [r["seconds"] / r["leaves"] for r in rounds]
        transformer = [r["transformer_s"] / r["leaves"] for r in rounds]
        summary[shape] = {
            "sampling": describe(params[shape]),
            "leaves": leaves,
            "forward_calls": sorted({r["forward_calls"] for r in rounds}),
            "rows": rows,
            "rows_per_leaf": statistics.median(r["rows"] / r["leaves"] for r in rounds),
            "expected_rows_per_leaf": expected_rows_per_leaf(params[shape]),
            **spread(per_leaf, "ms_per_leaf", 1e3),
            "transformer_ms_per_leaf": 1e3 * statistics.median(transformer),
            "other_ms_per_leaf": 1e3 * statistics.median(p - t for p, t in zip(per_leaf, transformer, strict=True)),
            "rounds": rounds,
        }
    flat = summary["flat"]
    for shape, row in summary.items():
        rounds = records[shape]
        row["forwards_vs_flat"] = row["rows_per_leaf"] / flat["rows_per_leaf"]
        row["wall_vs_flat"] = per_round_ratio(
            [r["seconds"] / r["leaves"] for r in rounds], [r["seconds"] / r["leaves"] for r in records["flat"]]
        )
        row["transformer_vs_flat"] = per_round_ratio(
            [r["transformer_s"] / r["leaves"] for r in rounds],
            [r["transformer_s"] / r["leaves"] for r in records["flat"]],
        )
        row["wall_over_forwards_ratio"] = row["wall_vs_flat"] / row["forwards_vs_flat"]
        row["wall_follows_forwards"] = abs(row["wall_over_forwards_ratio"] - 1) <= FOLLOW_TOLERANCE
    summary["targets"] = {
        "fast_forwards_ratio_met": summary["fast"]["forwards_vs_flat"] <= TARGET_FORWARDS_RATIO,
        "fast_wall_follows_forwards": summary["fast"]["wall_follows_forwards"],
    }
    return summary


def measure_rollouts(model: Path, args) -> dict:
    configs = recipe_configs()
    params = shape_params(configs)
    recipe_prompts = configs["flat"].prompts
    prompts = [recipe_prompts[i % len(recipe_prompts)] for i in range(args.prompts)]
    config = EngineConfig(model=str(model), executor="uni", max_batch_size=args.max_batch_size)
    with RolloutEngine(config) as engine:
        records = time_shapes(engine, prompts, params, args)
    return summarize_rollouts(records, params)


# Training.


def train_recipes(model: Path, folder: Path, args) -> dict[str, list[dict]]:
    """Per recipe, one record per seed: the summary's numbers, or the error that stopped the run."""
    results: dict[str, list[dict]] = {shape: [] for shape in SHAPES}
    for seed in args.train_seeds:
        for shape, (file, label) in SHAPES.items():
            overrides = [
                f"model.path={model}",
                f"output_dir={folder / f'{shape}-seed{seed}'}",
                f"steps={args.train_steps}",
                f"seed={seed}",
                f"prompts_per_step={args.train_prompts_per_step}",
                "eval.num_prompts=1",
                "eval.num_samples=1",
                "eval.num_inference_steps=2",
            ]
            logger.info(f"training {label} ({file}), seed {seed}, {args.train_steps} steps")
            try:
                config = load_config(CONFIGS / file, overrides)
                summary = recipe_module(config.recipe).run(config)
            except Exception as error:  # reported in the table; the other recipes still run
                logger.exception(f"{label}, seed {seed}: the recipe failed")
                results[shape].append({"seed": seed, "error": f"{type(error).__name__}: {error}"})
                continue
            minutes = summary["train_s"] / 60
            results[shape].append(
                {
                    "seed": seed,
                    "steps": summary["steps"],
                    "train_s": summary["train_s"],
                    "reward_first5": summary["reward_first5"],
                    "reward_last5": summary["reward_last5"],
                    "reward_margin": summary["reward_margin"],
                    "margin_per_minute": summary["reward_margin"] / minutes,
                    "log_ratio_before_first_update": summary["log_ratio_before_first_update"],
                }
            )
            logger.info(
                f"  {shape}: margin {summary['reward_margin']:+.4f} in {minutes:.2f} min "
                f"({summary['reward_margin'] / minutes:+.4f}/min)"
            )
    return results


# Report.


def print_report(rollouts: dict, training: dict | None, args) -> None:
    leaves = rollouts["flat"]["leaves"]
    print(
        f"\nrollouts: {args.prompts} prompts x 8 leaves = {leaves} leaves per generate, 8 steps, max batch "
        f"{args.max_batch_size}, {args.threads} threads; median of {args.repeats} rounds, ratios to flat are "
        "medians of per-round ratios"
    )
    header = (
        f"{'shape':<26} {'sampling':<38} {'forwards':>8} {'rows/leaf':>9} {'expected':>8} {'x flat':>6}"
        f" {'ms/leaf':>7} {'min':>6} {'max':>6} {'x flat':>6} {'tf ms/leaf':>10} {'x flat':>6} {'other ms':>8}"
    )
    print(header + "\n" + "-" * len(header))
    for shape, (_, label) in SHAPES.items():
        row = rollouts[shape]
        calls = "/".join(str(c) for c in row["forward_calls"])
        print(
            f"{label:<26} {row['sampling']:<38} {calls:>8} {row['rows_per_leaf']:>9.3f}"
            f" {row['expected_rows_per_leaf']:>8.3f} {row['forwards_vs_flat']:>6.3f}"
            f" {row['median_ms_per_leaf']:>7.2f} {row['min_ms_per_leaf']:>6.2f} {row['max_ms_per_leaf']:>6.2f}"
            f" {row['wall_vs_flat']:>6.3f} {row['transformer_ms_per_leaf']:>10.2f}"
            f" {row['transformer_vs_flat']:>6.3f} {row['other_ms_per_leaf']:>8.2f}"
        )
    print(
        "  forwards: run_transformer calls per generate; rows/leaf: their rows over the leaves; ms/leaf: generate's\n"
        "  wall time over its leaves; tf: the part inside run_transformer; other: the rest (encode, sampler,\n"
        "  history, decode, trajectories)"
    )
    print()
    for shape, (_, label) in SHAPES.items():
        row = rollouts[shape]
        matches = len(row["rows"]) == 1 and abs(row["rows_per_leaf"] - row["expected_rows_per_leaf"]) < 1e-9
        print(
            f"check {label:<26} rows/leaf {row['rows_per_leaf']:.3f} == expected {row['expected_rows_per_leaf']:.3f}"
            f" (rows per generate {row['rows']}): {'PASS' if matches else 'FAIL'}"
        )
    fast = rollouts["fast"]
    print(
        f"check Flow-GRPO-Fast forwards/leaf <= {TARGET_FORWARDS_RATIO}x flat: {fast['forwards_vs_flat']:.3f}x: "
        f"{'PASS' if rollouts['targets']['fast_forwards_ratio_met'] else 'FAIL'}"
    )
    for shape in ("fast", "tree"):
        row, label = rollouts[shape], SHAPES[shape][1]
        verdict = "PASS" if row["wall_follows_forwards"] else "FAIL"
        print(
            f"{'check' if shape == 'fast' else 'info '} {label} wall follows forwards (wall ratio within "
            f"{100 * FOLLOW_TOLERANCE:.0f}% of forwards ratio): wall {row['wall_vs_flat']:.3f}x vs forwards "
            f"{row['forwards_vs_flat']:.3f}x (wall/forwards {row['wall_over_forwards_ratio']:.3f}): "
            f"{verdict if shape == 'fast' else verdict.lower()}"
        )
    if training is None:
        return
    print(
        f"\ntraining: {args.train_steps} steps x {args.train_prompts_per_step} prompts x 8 leaves, seeds "
        f"{args.train_seeds}; margin = mean reward of the last {MARGIN_WINDOW} steps - of the first "
        f"{MARGIN_WINDOW}; minutes = the recipe's train_s (engine start, evals, rollouts, updates, pushes)"
    )
    header = (
        f"{'recipe':<26} {'seed':>4} {'first5':>8} {'last5':>8} {'margin':>8} {'minutes':>7} {'margin/min':>10}"
        f" {'|log ratio| before 1st update':>30}"
    )
    print(header + "\n" + "-" * len(header))
    for shape, (_, label) in SHAPES.items():
        for record in training[shape]:
            if "error" in record:
                print(f"{label:<26} {record['seed']:>4} FAILED: {record['error']}")
                continue
            log_ratio = record["log_ratio_before_first_update"]
            print(
                f"{label:<26} {record['seed']:>4} {record['reward_first5']:>8.4f} {record['reward_last5']:>8.4f}"
                f" {record['reward_margin']:>+8.4f} {record['train_s'] / 60:>7.2f}"
                f" {record['margin_per_minute']:>+10.4f} {'-' if log_ratio is None else f'{log_ratio:.1e}':>30}"
            )
        done = [r for r in training[shape] if "error" not in r]
        if len(args.train_seeds) > 1 and done:
            print(
                f"{'  mean':<26} {'':>4} {'':>8} {'':>8} {statistics.mean(r['reward_margin'] for r in done):>+8.4f}"
                f" {statistics.mean(r['train_s'] for r in done) / 60:>7.2f}"
                f" {statistics.mean(r['margin_per_minute'] for r in done):>+10.4f}"
            )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # the engine and the recipes: quiet
    logger.setLevel(logging.INFO)  # the progress lines
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the uni worker and the recipes' trainers run in this process
    start = time.perf_counter()
    print(
        f"torch {torch.__version__}, threads {args.threads}, cpus {os.cpu_count()}, load average "
        f"{os.getloadavg()[0]:.2f}; rounds {args.warmup} warmup + {args.repeats} timed",
        flush=True,
    )
    training = None
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-branching-") as tmp:
            model = args.model or build_tiny_sd3(Path(tmp) / "tiny", seed=0)
            rollouts = measure_rollouts(model, args)
            if not args.skip_training:
                training = train_recipes(model, Path(tmp) / "runs", args)
    finally:
        torch.set_num_threads(previous_threads)
    print_report(rollouts, training, args)
    total = time.perf_counter() - start
    print(f"\ntotal {total:.1f} s; load average now {os.getloadavg()[0]:.2f}")
    result = {
        "args": json_args(args),
        "torch_version": torch.__version__,
        "targets": {"fast_forwards_vs_flat_max": TARGET_FORWARDS_RATIO, "wall_follow_tolerance": FOLLOW_TOLERANCE},
        "rollouts": rollouts,
        "training": training,
        "total_s": total,
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
