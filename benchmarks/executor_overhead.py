"""Executor overhead: what each backend adds to an engine step, and how `mp` scales out.

Part 1, overhead (tiny SD3 pipeline): one engine per backend (`uni`, `mp` and `ray`, 1 worker
each), all resident at once. Each round adds requests with 20..50 denoising steps (so they finish
at different engine steps) and steps every backend to completion, in a rotated order. Per step,
from the engine's `StepReport`:

  overhead     = the step's wall time - the worker's `compute_s` (its time inside
                 `Worker.execute`): scheduler, executor hop, wire format, outputs;
  executor hop = the executor call's time (`execute_s`) - compute_s;
  engine cpu   = the CPU time of the engine's thread in `engine.step()` (with `mp` the transport's
                 engine side; with `uni` the worker runs on a thread of its own, not counted):
                 under a loaded machine the CPU time holds steady where wall time does not.

Steps where no request finishes and steps where some finish (those carry images and trajectories
back through shared memory / the object store) are reported apart (median and p90, in us), and all
steps by their mean (the amortized cost per step). Each round also times trivial
`collective_rpc("get_rank")` round trips. The target: `mp` adds under 1 ms per step over `uni`.

Part 2, data-parallel scaling (a bigger transformer, a few hundred ms per step): images/s through
`engine.generate` with `mp` 1 worker x 1 thread, 2 workers x 1 thread (the same per-worker compute,
scaled out) and, for reference, 1 worker x 2 threads. Every round generates `--samples` samples
with `max_batch_size` per worker, so 2 workers split them evenly. The target: 2 workers reach
>= 1.6x the throughput of 1 on two cores.

Rounds are interleaved, warmup rounds are discarded, medians are reported. CPU only: `compute_s`
does not synchronize a GPU.

    python -m benchmarks.executor_overhead                       # both parts, all backends
    python -m benchmarks.executor_overhead --backends uni mp --parts overhead --json out.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import tempfile
import time

import torch

from benchmarks import harness
from benchmarks.harness import Stats, Target, count, positive_int
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.engine.step_report import StepReport
from rollout.pipelines.tiny import TinySD3Sizes, build_tiny_sd3

BACKENDS = ("uni", "mp", "ray")
PARTS = ("overhead", "scaling")
STEP_KINDS = {"plain": "no request finishes", "finishing": "requests finish", "all": "all steps"}
# (label, num_workers, threads_per_worker) of part 2; the first is the baseline of the ratios.
SCALING_CONFIGS = (
    ("mp 1 worker x 1 thread", 1, 1),
    ("mp 2 workers x 1 thread", 2, 1),
    ("mp 1 worker x 2 threads", 1, 2),
)
TARGET_MP_EXTRA_US = 1000.0  # mp's step overhead minus uni's
TARGET_SCALING = 1.6  # images/s of 2 workers / 1 worker
RATIO_LABELS = (  # of part 2's ratios, in their order
    "2 workers / 1 worker (medians)",
    "2 workers / 1 worker (per-round median)",
    "1 worker x 2 threads / 1 worker x 1 thread",
    "2 workers x 1 thread / 1 worker x 2 threads",
)
flow_sde_params = functools.partial(SamplingParams, sampler="flow_sde", return_trajectory=True)


def build_parser():
    parser = harness.parser("executor_overhead", __doc__, repeats=3, warmup=1, threads=1)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    over = parser.add_argument_group("part 1: per-step overhead (tiny pipeline; --repeats and --warmup rounds)")
    over.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="backends to measure")
    over.add_argument("--requests", type=positive_int, default=12, help="prompts per round, one request group each")
    over.add_argument("--group-size", type=positive_int, default=1, help="samples per prompt (num_samples)")
    over.add_argument("--min-steps", type=positive_int, default=20, help="denoising steps of the first prompt")
    over.add_argument("--max-steps", type=positive_int, default=50, help="denoising steps of the last prompt")
    over.add_argument("--batch-size", type=positive_int, default=4, help="max_batch_size of the overhead engines")
    over.add_argument("--rpc-calls", type=positive_int, default=100, help="collective_rpc('get_rank') calls per round")
    over.add_argument("--ray-cpus", type=positive_int, default=2, help="num_cpus of the local ray.init()")
    scale = parser.add_argument_group("part 2: data-parallel scaling (mp, bigger transformer)")
    scale.add_argument("--scaling-repeats", type=positive_int, default=3, help="timed rounds (all three configs)")
    scale.add_argument("--scaling-warmup", type=count, default=1, help="untimed rounds first")
    scale.add_argument("--samples", type=positive_int, default=16, help="samples per generate() call (one prompt)")
    scale.add_argument("--scaling-batch-size", type=positive_int, default=8, help="max_batch_size (per worker)")
    scale.add_argument("--scaling-steps", type=positive_int, default=8, help="denoising steps per sample")
    scale.add_argument("--sample-size", type=positive_int, default=16, help="latent height and width (image is 2x)")
    scale.add_argument("--num-layers", type=positive_int, default=4, help="transformer blocks")
    scale.add_argument("--num-heads", type=positive_int, default=4, help="attention heads")
    scale.add_argument("--head-dim", type=positive_int, default=32, help="width of one head (hidden = heads x this)")
    return parser


class Engine:
    """A started engine, its startup seconds, and its step reports since the last `take`."""

    def __init__(self, stack: contextlib.ExitStack, label: str, config: EngineConfig):
        start = time.perf_counter()
        self.engine = stack.enter_context(RolloutEngine(config))  # shut down when `stack` closes
        self.startup_s = time.perf_counter() - start
        print(f"  started {label} in {self.startup_s:6.2f} s", flush=True)
        self.reports: list[StepReport] = []
        self.engine.add_step_observer(self.reports.append)

    def take(self, kind: str) -> list[StepReport]:
        taken = [r for r in self.reports if r.kind == kind]
        self.reports.clear()
        return taken


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in `obj`, looking into dataclasses (a `RolloutOutput` and its parts)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if dataclasses.is_dataclass(obj):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def stats(values: list[float]) -> dict | None:
    """Stats.to_json() plus the mean (the amortized cost); None without values."""
    return Stats.of(values).to_json() | {"mean": statistics.mean(values)} if values else None


# Part 1: overhead.


def overhead_round(started: Engine, args, seed: int) -> tuple[list[tuple[StepReport, int, float]], list[float]]:
    """Add this round's requests and step them to completion (one record per step that reached the
    workers: its report, its outputs' bytes and the engine thread's CPU seconds in it), then time
    `--rpc-calls` get_rank RPCs."""
    engine = started.engine
    for i in range(args.requests):
        steps = args.min_steps + round(i * (args.max_steps - args.min_steps) / max(args.requests - 1, 1))
        params = flow_sde_params(num_inference_steps=steps, num_samples=args.group_size, seed=seed * 1000 + i)
        engine.add_request(f"prompt {i} of round {seed}", params, prompt_index=i)
    records = []
    started.take("step")
    while engine.has_unfinished_requests():
        cpu_start = time.thread_time()
        outputs = engine.step()
        cpu_s = time.thread_time() - cpu_start
        output_bytes = sum(tensor_bytes(o) for o in outputs)
        records += [(r, output_bytes, cpu_s) for r in started.take("step")]  # none for a step with nothing scheduled
    for _ in range(args.rpc_calls):
        engine.collective_rpc("get_rank")
    return records, [r.wall_s for r in started.take("rpc")]


def run_overhead(args, report: harness.Report) -> None:
    backends = [b for b in BACKENDS if b in args.backends]
    steps: dict[str, list[tuple[StepReport, int, float]]] = {b: [] for b in backends}
    rpcs: dict[str, list[float]] = {b: [] for b in backends}

    def run(backend: str, round_: harness.Round) -> dict:
        (records, rpc_times), elapsed = harness.timed_call(overhead_round, engines[backend], args, round_.index)
        if round_.timed:
            steps[backend] += records
            rpcs[backend] += rpc_times
        return {"s": elapsed, "steps": len(records)}

    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(args.threads)  # the uni worker runs in this process
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout-bench-"))
        if "ray" in backends:
            import ray

            ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
            stack.callback(ray.shutdown)
        build_tiny_sd3(folder, seed=0)
        settings = dict(model=folder, num_workers=1, max_batch_size=args.batch_size, threads_per_worker=args.threads)
        engines = {b: Engine(stack, f"{b:<4}", EngineConfig(executor=b, **settings)) for b in backends}
        harness.run_rounds({b: functools.partial(run, b) for b in backends}, args.warmup, args.repeats)
    summarize_overhead(steps, rpcs, {b: engines[b].startup_s for b in backends}, report)


def summarize_overhead(steps: dict, rpcs: dict, startup: dict, report: harness.Report) -> None:
    result = {}
    for backend, records in steps.items():
        kinds = {}
        for kind in STEP_KINDS:
            chosen = [(r, n, c) for r, n, c in records if kind == "all" or (r.finished > 0) == (kind == "finishing")]
            kinds[kind] = {
                "overhead_us": stats([1e6 * (r.wall_s - max(r.compute_s)) for r, _, _ in chosen]),
                "executor_us": stats([1e6 * (r.execute_s - max(r.compute_s)) for r, _, _ in chosen]),
                "engine_cpu_us": stats([1e6 * c for _, _, c in chosen]),
                "compute_ms": stats([1e3 * max(r.compute_s) for r, _, _ in chosen]),
                "finished_per_step": statistics.mean(r.finished for r, _, _ in chosen) if chosen else 0.0,
                "kib_per_step": statistics.mean(n for _, n, _ in chosen) / 1024 if chosen else 0.0,
            }
        rpc_us = stats([1e6 * t for t in rpcs[backend]])
        result[backend] = {"startup_s": startup[backend], "steps": kinds, "rpc_us": rpc_us}
    report.results["overhead"] = result

    def row(backend: str, kind: str) -> list:
        k = result[backend]["steps"][kind]
        over, hop = k["overhead_us"], k["executor_us"]
        measured = [0] + ["-"] * 7
        if over:
            measured = [over["n"], k["compute_ms"]["median"], over["median"], over["p90"], over["mean"]]
            measured += [hop["median"], hop["p90"], k["engine_cpu_us"]["median"]]
        return [backend, STEP_KINDS[kind], *measured, k["finished_per_step"], k["kib_per_step"]]

    report.table(
        "Part 1: per-step overhead (us)",
        ["backend", "steps", "n", "compute ms", "overhead med", "p90", "mean", "executor med", "p90"]
        + ["engine cpu med", "done/step", "KiB/step"],
        [row(backend, kind) for backend in result for kind in STEP_KINDS],
        note="overhead = StepReport.wall_s - the worker's compute_s; executor = execute_s - compute_s (the rest:\n"
        "scheduler and outputs, the same code on every backend); engine cpu = the engine thread's CPU time in step()",
    )
    report.table(
        "get_rank round trips",
        ["backend", "rpc med us", "p90 us", "calls", "startup s"],
        [[b, r["rpc_us"]["median"], r["rpc_us"]["p90"], r["rpc_us"]["n"], r["startup_s"]] for b, r in result.items()],
    )
    if "uni" not in result or len(result) == 1:
        return
    # Per step kind the difference of medians; over all steps the difference of means (amortized).
    added, rows, uni = {}, [], result["uni"]
    for backend, ours in ((b, r) for b, r in result.items() if b != "uni"):
        for kind, label in STEP_KINDS.items():
            statistic = "mean" if kind == "all" else "median"
            mine, theirs = ours["steps"][kind]["overhead_us"], uni["steps"][kind]["overhead_us"]
            value = mine[statistic] - theirs[statistic] if mine and theirs else float("nan")
            added[f"{backend}_{kind}_us"] = value
            rows.append([backend, label, statistic, value])
            if backend == "mp":
                report.check(Target(f"mp adds over uni, {label} (us)", value, "<", TARGET_MP_EXTRA_US))
        added[f"{backend}_rpc_us"] = ours["rpc_us"]["median"] - uni["rpc_us"]["median"]
        rows.append([backend, "get_rank rpc", "median", added[f"{backend}_rpc_us"]])
    report.results["overhead_added_over_uni_us"] = added
    report.table("added over uni (us)", ["backend", "steps", "difference of", "us"], rows)


# Part 2: scaling.


def run_scaling(args, report: harness.Report) -> None:
    sizes = TinySD3Sizes(
        sample_size=args.sample_size,
        num_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        attention_head_dim=args.head_dim,
    )
    print(f"  sizes: {sizes}")

    def run(label: str, round_: harness.Round) -> dict:
        params = flow_sde_params(num_inference_steps=args.scaling_steps, num_samples=args.samples, seed=round_.index)
        engines[label].take("step")
        outputs, elapsed = harness.timed_call(engines[label].engine.generate, ["a red cube on a blue table"], params)
        assert len(outputs) == args.samples
        steps = engines[label].take("step")
        busy = sum(sum(s.compute_s) for s in steps) / (len(steps[0].compute_s) * elapsed)  # per worker, of the wall
        return {"s": elapsed, "busy": busy, "steps": len(steps)}

    with contextlib.ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout-bench-"))
        build_tiny_sd3(folder, seed=0, sizes=sizes)
        settings = dict(model=folder, executor="mp", max_batch_size=args.scaling_batch_size)
        engines = {
            label: Engine(stack, label, EngineConfig(num_workers=workers, threads_per_worker=threads, **settings))
            for label, workers, threads in SCALING_CONFIGS
        }
        modes = {label: functools.partial(run, label) for label in engines}
        samples = harness.run_rounds(modes, args.scaling_warmup, args.scaling_repeats)
    summarize_scaling(samples, args.samples, report)


def summarize_scaling(samples: dict, images: int, report: harness.Report) -> None:
    times = {label: Stats.of(s["s"]) for label, s in samples.items()}
    configs = {
        label: {"s": t, "images_per_s": images / t.median, "worker_busy": statistics.median(samples[label]["busy"])}
        for label, t in times.items()
    }
    base, two, threads = times
    ratios = {
        "two_workers_vs_one": times[base].median / times[two].median,
        "two_workers_vs_one_per_round": harness.per_round_ratio(samples[base]["s"], samples[two]["s"]),
        "two_threads_vs_one": times[base].median / times[threads].median,
        "two_workers_vs_two_threads": times[threads].median / times[two].median,
    }
    report.results["scaling"] = {"configs": configs, "ratios": ratios}
    report.table(
        "Part 2: data-parallel scaling (images/s through engine.generate)",
        ["config", "median s", "min s", "max s", "images/s", "x 1 worker", "workers busy %"],
        [
            [label, c["s"].median, c["s"].min, c["s"].max, c["images_per_s"]]
            + [c["images_per_s"] / configs[base]["images_per_s"], 100 * c["worker_busy"]]
            for label, c in configs.items()
        ],
    )
    report.table("throughput ratios", ["ratio", "value"], zip(RATIO_LABELS, ratios.values(), strict=True))
    report.check(Target("mp 2 workers / 1 worker throughput", ratios["two_workers_vs_one"], ">=", TARGET_SCALING))


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_steps < args.min_steps:
        parser.error(f"--max-steps ({args.max_steps}) must be >= --min-steps ({args.min_steps})")
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    report = harness.Report("executor_overhead", args, __doc__, argv)
    begin = time.perf_counter()
    if "overhead" in args.parts:
        report.note(
            f"Part 1: backends {', '.join(args.backends)}; per round {args.requests} prompts x {args.group_size} "
            f"samples, {args.min_steps}..{args.max_steps} steps, max_batch_size {args.batch_size}, "
            f"{args.threads} worker thread(s); {args.warmup} warmup + {args.repeats} timed rounds"
        )
        run_overhead(args, report)
    if "scaling" in args.parts:
        report.note(
            f"Part 2: {args.samples} samples x {args.scaling_steps} steps per round, max_batch_size "
            f"{args.scaling_batch_size} per worker; {args.scaling_warmup} warmup + {args.scaling_repeats} timed rounds"
        )
        run_scaling(args, report)
    report.results["total_s"] = time.perf_counter() - begin
    return report.finish()


if __name__ == "__main__":
    main()
