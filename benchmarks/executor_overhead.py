"""Executor overhead: what each backend adds to an engine step, and how `mp` scales out.

Part 1, overhead (tiny SD3 pipeline, default sizes): one engine per backend (`uni`, `mp` with 1
worker, `ray` with 1 worker), all resident at once. Each round adds requests with 20..50 denoising
steps (so they finish at different engine steps) and drives `engine.step()` to completion on every
backend, in a rotated order. For every step:

  overhead     = wall time of `engine.step()` - the worker's `RunnerOutput.compute_s` (the time it
                 spent inside `Worker.execute`): scheduler, executor hop, wire format, outputs;
  executor hop = wall time of `engine.executor.execute` (timed by a wrapper installed on the engine's
                 executor in this process, no library code changed) - compute_s.

Steps where no request finishes and steps where some finish (those carry images and trajectories
back through shared memory / the object store) are reported apart, as median and p90 in
microseconds, and all steps together by their mean (the amortized cost per step). Each round also
times trivial `collective_rpc("get_rank")` round trips. The target: `mp` adds under 1 ms per step
over `uni`.

Part 2, data-parallel scaling (a bigger transformer, so a step takes a few hundred ms): images/s
through `engine.generate` with `mp` 1 worker x 1 thread, 2 workers x 1 thread (the same per-worker
compute, scaled out) and, for reference, 1 worker x 2 threads (all cores to one replica). Every
round generates `--samples` samples with `max_batch_size` per worker, so 2 workers split them
evenly. The target: 2 workers reach >= 1.6x the throughput of 1 on two cores.

Rounds are interleaved (each runs every configuration, in a rotated order), warmup rounds are
discarded, medians are reported. CPU only: `compute_s` does not synchronize a GPU.

(Past the ~400-line guide on purpose: the two parts share the executor timer, the statistics and
the report, and a benchmark reads best as one script.)

    python -m benchmarks.executor_overhead                       # both parts, all backends
    python -m benchmarks.executor_overhead --backends uni mp --parts overhead
    python -m benchmarks.executor_overhead --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import interleaved_rounds, json_args, per_round_ratio, spread, timed_call, write_json
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.tiny import TinySD3Sizes, build_tiny_sd3

BACKENDS = ("uni", "mp", "ray")
PARTS = ("overhead", "scaling")
STEP_KINDS = ("plain", "finishing", "all")
STEP_KIND_LABELS = {"plain": "no request finishes", "finishing": "requests finish", "all": "all steps"}
# (label, num_workers, threads_per_worker) of part 2; the first is the baseline of the ratios.
SCALING_CONFIGS = (
    ("mp 1 worker x 1 thread", 1, 1),
    ("mp 2 workers x 1 thread", 2, 1),
    ("mp 1 worker x 2 threads", 1, 2),
)
# The project's targets.
TARGET_MP_EXTRA_US = 1000.0  # mp's median step overhead minus uni's
TARGET_SCALING = 1.6  # images/s of 2 workers / 1 worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.executor_overhead",
        description=__doc__.split("\n\n")[0]
        + " Prints per-step overhead per backend (median/p90 us), RPC round trips, and mp throughput"
        " with 1 vs 2 workers, with the ratios against the project's targets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = parser.add_argument_group("what to run")
    run.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    run.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")

    over = parser.add_argument_group("part 1: per-step overhead (tiny pipeline)")
    over.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="backends to measure")
    over.add_argument("--rounds", type=int, default=3, help="timed rounds; each drives every backend's workload once")
    over.add_argument("--warmup", type=int, default=1, help="untimed rounds first (allocator, caches, first calls)")
    over.add_argument("--requests", type=int, default=12, help="prompts added per round, one request group each")
    over.add_argument("--group-size", type=int, default=1, help="samples per prompt (SamplingParams.num_samples)")
    over.add_argument(
        "--min-steps", type=int, default=20, help="denoising steps of the first prompt; the others spread to max"
    )
    over.add_argument("--max-steps", type=int, default=50, help="denoising steps of the last prompt")
    over.add_argument("--batch-size", type=int, default=4, help="max_batch_size of the overhead engines")
    over.add_argument("--threads", type=int, default=1, help="torch threads of the worker (uni: this process's)")
    over.add_argument("--rpc-calls", type=int, default=100, help="collective_rpc('get_rank') calls per round")
    over.add_argument("--ray-cpus", type=int, default=2, help="num_cpus of the local ray.init()")

    scale = parser.add_argument_group("part 2: data-parallel scaling (mp, bigger transformer)")
    scale.add_argument("--scaling-rounds", type=int, default=3, help="timed rounds; each runs all three configs")
    scale.add_argument("--scaling-warmup", type=int, default=1, help="untimed rounds first")
    scale.add_argument("--samples", type=int, default=16, help="samples per generate() call (one prompt)")
    scale.add_argument("--scaling-batch-size", type=int, default=8, help="max_batch_size (per worker)")
    scale.add_argument("--scaling-steps", type=int, default=8, help="denoising steps per sample")
    scale.add_argument("--sample-size", type=int, default=16, help="latent height and width (image is 2x)")
    scale.add_argument("--num-layers", type=int, default=4, help="transformer blocks")
    scale.add_argument("--num-heads", type=int, default=4, help="attention heads")
    scale.add_argument("--head-dim", type=int, default=32, help="width of one head (hidden = heads x head-dim)")
    args = parser.parse_args(argv)
    positive = ("rounds", "requests", "group_size", "min_steps", "batch_size", "threads", "rpc_calls", "ray_cpus")
    positive += ("scaling_rounds", "samples", "scaling_batch_size", "scaling_steps")
    bad = [f"--{name.replace('_', '-')}" for name in positive if getattr(args, name) < 1]
    bad += [f"--{name}" for name in ("warmup", "scaling_warmup") if getattr(args, name) < 0]
    if bad:
        parser.error(f"{', '.join(bad)} must be >= 1 (warmups >= 0)")
    if args.max_steps < args.min_steps:
        parser.error(f"--max-steps ({args.max_steps}) must be >= --min-steps ({args.min_steps})")
    return args


# Timing the executor from the benchmark process.


@dataclass
class ExecuteCall:
    wall_s: float
    compute_s: list[float]  # per rank, in rank order (0 for a rank with nothing to do)


@dataclass
class ExecuteTimer:
    """Replaces `engine.executor.execute` (an instance attribute shadows the method) with a wrapper
    that records the call's wall time and every rank's `compute_s`."""

    executor: object
    calls: list[ExecuteCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        inner = self.executor.execute

        def execute(scheduler_output):
            start = time.perf_counter()
            outputs = inner(scheduler_output)
            self.calls.append(ExecuteCall(time.perf_counter() - start, [o.compute_s for o in outputs]))
            return outputs

        self.executor.execute = execute

    def remove(self) -> None:
        del self.executor.execute

    def take(self) -> list[ExecuteCall]:
        calls, self.calls = self.calls, []
        return calls


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in `obj`, looking into dataclasses (a `RolloutOutput`, its `Trajectory`
    and its `Condition`)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if dataclasses.is_dataclass(obj):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "median": float("nan"), "p90": float("nan"), "mean": float("nan")}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "mean": statistics.mean(values),
    }


# Part 1: overhead.


def overhead_workload(engine: RolloutEngine, timer: ExecuteTimer, args: argparse.Namespace, seed: int) -> list[dict]:
    """Add this round's requests and step them to completion; one record per engine step."""
    count = args.requests
    for i in range(count):
        steps = args.min_steps + round(i * (args.max_steps - args.min_steps) / max(count - 1, 1))
        params = SamplingParams(
            num_inference_steps=steps,
            num_samples=args.group_size,
            seed=seed * 1000 + i,
            sampler="flow_sde",
            return_trajectory=True,
        )
        engine.add_request(f"prompt {i} of round {seed}", params, prompt_index=i)
    records = []
    timer.take()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - start
        calls = timer.take()
        if len(calls) != 1:  # a step that did not reach the workers (nothing scheduled) tells nothing
            continue
        compute = max(calls[0].compute_s)
        records.append(
            {
                "wall_s": wall,
                "execute_s": calls[0].wall_s,
                "compute_s": compute,
                "finished": len(outputs),
                "bytes": sum(tensor_bytes(o) for o in outputs),
            }
        )
    return records


def time_rpc(engine: RolloutEngine, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        engine.collective_rpc("get_rank")
        times.append(time.perf_counter() - start)
    return times


def overhead_round(engine: RolloutEngine, timer: ExecuteTimer, args: argparse.Namespace, seed: int):
    """One backend's share of a round: the workload's step records, then `--rpc-calls` RPC times."""
    return overhead_workload(engine, timer, args, seed), time_rpc(engine, args.rpc_calls)


def run_overhead(args: argparse.Namespace) -> dict:
    backends = [b for b in BACKENDS if b in args.backends]
    ray = None
    if "ray" in backends:
        import ray

        ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the uni worker runs in this process
    engines, timers, startup = {}, {}, {}
    steps = {b: [] for b in backends}
    rpcs = {b: [] for b in backends}
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-") as folder:
            build_tiny_sd3(folder, seed=0)
            for backend in backends:
                start = time.perf_counter()
                engines[backend] = RolloutEngine(
                    EngineConfig(
                        model=folder,
                        executor=backend,
                        num_workers=1,
                        max_batch_size=args.batch_size,
                        threads_per_worker=args.threads,
                    )
                )
                startup[backend] = time.perf_counter() - start
                timers[backend] = ExecuteTimer(engines[backend].executor)
                print(f"  started {backend:<4} in {startup[backend]:6.2f} s", flush=True)
            for round_ in interleaved_rounds(backends, args.warmup, args.rounds):
                for backend in round_.order:
                    engine, timer = engines[backend], timers[backend]
                    (records, rpc_times), elapsed = timed_call(overhead_round, engine, timer, args, round_.index)
                    if round_.timed:
                        steps[backend] += records
                        rpcs[backend] += rpc_times
                    print(
                        f"  [{round_.tag}] {backend:<4} {len(records):4d} steps + {args.rpc_calls} rpcs"
                        f" {elapsed:7.2f} s",
                        flush=True,
                    )
            for backend in backends:
                timers[backend].remove()
    finally:
        for engine in engines.values():
            engine.shutdown()
        torch.set_num_threads(previous_threads)
        if ray is not None:
            ray.shutdown()
    return summarize_overhead(steps, rpcs, startup)


def summarize_overhead(steps: dict[str, list[dict]], rpcs: dict[str, list[float]], startup: dict) -> dict:
    result = {}
    for backend, records in steps.items():
        kinds = {}
        for kind in STEP_KINDS:
            chosen = [r for r in records if kind == "all" or (r["finished"] > 0) == (kind == "finishing")]
            kinds[kind] = {
                "overhead_us": stats([1e6 * (r["wall_s"] - r["compute_s"]) for r in chosen]),
                "executor_us": stats([1e6 * (r["execute_s"] - r["compute_s"]) for r in chosen]),
                "compute_ms": stats([1e3 * r["compute_s"] for r in chosen]),
                "finished_per_step": statistics.mean(r["finished"] for r in chosen) if chosen else 0.0,
                "kib_per_step": statistics.mean(r["bytes"] for r in chosen) / 1024 if chosen else 0.0,
            }
        result[backend] = {
            "startup_s": startup[backend],
            "steps": kinds,
            "rpc_us": stats([1e6 * t for t in rpcs[backend]]),
        }
    return result


def added_over_uni(summary: dict) -> dict[str, float]:
    """Microseconds each backend adds to uni's overhead: per step kind the difference of medians,
    over all steps the difference of means (the amortized cost per step), and per RPC."""
    added = {}
    for backend in (b for b in summary if b != "uni"):
        for kind in STEP_KINDS:
            statistic = "mean" if kind == "all" else "median"
            added[f"{backend}_{kind}_us"] = (
                summary[backend]["steps"][kind]["overhead_us"][statistic]
                - summary["uni"]["steps"][kind]["overhead_us"][statistic]
            )
        added[f"{backend}_rpc_us"] = summary[backend]["rpc_us"]["median"] - summary["uni"]["rpc_us"]["median"]
    return added


def print_overhead(summary: dict, added: dict[str, float] | None) -> None:
    print("\nPart 1: per-step overhead = engine.step() wall - worker compute_s (us); executor hop = the")
    print("executor.execute() call's share of it (the rest: scheduler and outputs, same code on every backend)")
    header = (
        f"{'backend':<8} {'steps':<20} {'n':>5} {'compute ms':>10} {'overhead med':>13} {'p90':>7} {'mean':>7}"
        f" {'executor med':>13} {'p90':>7} {'done/step':>9} {'KiB/step':>9}"
    )
    print("\n" + header)
    print("-" * len(header))
    for backend, row in summary.items():
        for kind in STEP_KINDS:
            k = row["steps"][kind]
            print(
                f"{backend:<8} {STEP_KIND_LABELS[kind]:<20} {k['overhead_us']['n']:>5} "
                f"{k['compute_ms']['median']:>10.2f} {k['overhead_us']['median']:>13.0f}"
                f" {k['overhead_us']['p90']:>7.0f} {k['overhead_us']['mean']:>7.0f}"
                f" {k['executor_us']['median']:>13.0f} {k['executor_us']['p90']:>7.0f}"
                f" {k['finished_per_step']:>9.2f} {k['kib_per_step']:>9.1f}"
            )
    header = f"{'backend':<8} {'get_rank rpc med us':>20} {'p90 us':>8} {'calls':>6} {'startup s':>10}"
    print("\n" + header)
    print("-" * len(header))
    for backend, row in summary.items():
        rpc = row["rpc_us"]
        print(f"{backend:<8} {rpc['median']:>20.0f} {rpc['p90']:>8.0f} {rpc['n']:>6} {row['startup_s']:>10.2f}")
    if not added:  # no uni to compare with, or nothing but uni
        return
    print(
        f"\nadded over uni, us (per kind: difference of medians; all steps: of means)"
        f"   target: mp adds < {TARGET_MP_EXTRA_US:.0f} us per step"
    )
    for backend in (b for b in summary if b != "uni"):
        for kind in STEP_KINDS:
            value = added[f"{backend}_{kind}_us"]
            verdict = ("met" if value < TARGET_MP_EXTRA_US else "MISSED") if backend == "mp" else ""
            print(f"  {backend:<4} {STEP_KIND_LABELS[kind]:<20} {value:>8.0f}  {verdict}")
        print(f"  {backend:<4} {'get_rank rpc':<20} {added[f'{backend}_rpc_us']:>8.0f}")


# Part 2: scaling.


def run_scaling(args: argparse.Namespace) -> dict:
    sizes = TinySD3Sizes(
        sample_size=args.sample_size,
        num_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        attention_head_dim=args.head_dim,
    )
    print(f"  sizes: {sizes}")
    labels = [label for label, _, _ in SCALING_CONFIGS]
    times = {label: [] for label in labels}
    busy = {label: [] for label in labels}
    engines, timers = {}, {}
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-") as folder:
            build_tiny_sd3(folder, seed=0, sizes=sizes)
            for label, workers, threads in SCALING_CONFIGS:
                start = time.perf_counter()
                engines[label] = RolloutEngine(
                    EngineConfig(
                        model=folder,
                        executor="mp",
                        num_workers=workers,
                        threads_per_worker=threads,
                        max_batch_size=args.scaling_batch_size,
                    )
                )
                timers[label] = ExecuteTimer(engines[label].executor)
                print(f"  started {label} in {time.perf_counter() - start:6.2f} s", flush=True)
            for round_ in interleaved_rounds(labels, args.scaling_warmup, args.scaling_rounds):
                for label in round_.order:
                    params = SamplingParams(
                        num_inference_steps=args.scaling_steps,
                        num_samples=args.samples,
                        seed=round_.index,
                        sampler="flow_sde",
                        return_trajectory=True,
                    )
                    timers[label].take()
                    outputs, elapsed = timed_call(engines[label].generate, ["a red cube on a blue table"], params)
                    assert len(outputs) == args.samples
                    calls = timers[label].take()
                    # Share of the wall time each worker spent computing, averaged over workers.
                    workers = len(calls[0].compute_s)
                    utilization = sum(sum(c.compute_s) for c in calls) / (workers * elapsed)
                    if round_.timed:
                        times[label].append(elapsed)
                        busy[label].append(utilization)
                    print(
                        f"  [{round_.tag}] {label:<24} {elapsed:7.2f} s  {len(calls)} steps, workers busy "
                        f"{100 * utilization:4.0f} %",
                        flush=True,
                    )
            for timer in timers.values():
                timer.remove()
    finally:
        for engine in engines.values():
            engine.shutdown()
    return summarize_scaling(times, busy, args.samples)


def summarize_scaling(times: dict[str, list[float]], busy: dict[str, list[float]], samples: int) -> dict:
    configs = {
        label: {
            **spread(values),
            "images_per_s": samples / statistics.median(values),
            "worker_busy": statistics.median(busy[label]),
            "times_s": values,
        }
        for label, values in times.items()
    }
    base, two, threads = (label for label, _, _ in SCALING_CONFIGS)
    ratios = {
        "two_workers_vs_one": configs[base]["median_s"] / configs[two]["median_s"],
        "two_workers_vs_one_per_round": per_round_ratio(times[base], times[two]),
        "two_threads_vs_one": configs[base]["median_s"] / configs[threads]["median_s"],
        "two_workers_vs_two_threads": configs[threads]["median_s"] / configs[two]["median_s"],
    }
    return {"configs": configs, "ratios": ratios}


def print_scaling(result: dict) -> None:
    configs, ratios = result["configs"], result["ratios"]
    base = configs[SCALING_CONFIGS[0][0]]
    print("\nPart 2: data-parallel scaling (images/s through engine.generate)")
    header = (
        f"{'config':<26} {'median s':>9} {'min s':>8} {'max s':>8} {'images/s':>9} {'x 1 worker':>11}"
        f" {'workers busy':>13}"
    )
    print("\n" + header)
    print("-" * len(header))
    for label, row in configs.items():
        print(
            f"{label:<26} {row['median_s']:>9.3f} {row['min_s']:>8.3f} {row['max_s']:>8.3f} "
            f"{row['images_per_s']:>9.3f} {row['images_per_s'] / base['images_per_s']:>11.3f}"
            f" {100 * row['worker_busy']:>12.0f}%"
        )
    ok = ratios["two_workers_vs_one"] >= TARGET_SCALING
    print(
        f"\n2 workers / 1 worker throughput: {ratios['two_workers_vs_one']:.3f} (medians), "
        f"{ratios['two_workers_vs_one_per_round']:.3f} (per-round median)   "
        f"target >= {TARGET_SCALING}: {'met' if ok else 'MISSED'}"
    )
    print(f"1 worker x 2 threads / 1 worker x 1 thread:   {ratios['two_threads_vs_one']:.3f}")
    print(f"2 workers x 1 thread / 1 worker x 2 threads:  {ratios['two_workers_vs_two_threads']:.3f}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    begin = time.perf_counter()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, this process's torch threads {torch.get_num_threads()}")
    result: dict = {
        "args": json_args(args),
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
    }
    if "overhead" in args.parts:
        print(
            f"\nPart 1: backends {', '.join(args.backends)}; per round {args.requests} prompts x {args.group_size} "
            f"samples, {args.min_steps}..{args.max_steps} steps, max_batch_size {args.batch_size}, "
            f"{args.threads} worker thread(s); {args.warmup} warmup + {args.rounds} timed rounds"
        )
        result["overhead"] = run_overhead(args)
    if "scaling" in args.parts:
        print(
            f"\nPart 2: {args.samples} samples x {args.scaling_steps} steps per round, max_batch_size "
            f"{args.scaling_batch_size} per worker; {args.scaling_warmup} warmup + {args.scaling_rounds} timed rounds"
        )
        result["scaling"] = run_scaling(args)
    if "overhead" in result:
        added = added_over_uni(result["overhead"]) if "uni" in result["overhead"] else None
        result["overhead_added_over_uni_us"] = added
        print_overhead(result["overhead"], added)
    if "scaling" in result:
        print_scaling(result["scaling"])
    result["total_s"] = time.perf_counter() - begin
    print(f"\ntotal {result['total_s']:.1f} s")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
