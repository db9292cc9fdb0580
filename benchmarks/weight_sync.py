"""Weight sync: seconds and GB/s of pushing a full transformer into the engine, per backend.

Builds an SD3 pipeline (random weights; a transformer of a few hundred MB of float32, tiny VAE and
text encoders) in a temporary folder, loads the transformer a second time as the trainer's copy,
and measures, for the same bytes (every tensor of `base_state(trainer)`):

  copy floor  `dst.copy_(src)` for every tensor into tensors allocated (and touched) beforehand:
              the memory bandwidth any push is bounded by;
  clone       `src.clone()` for every tensor: the same copy into new tensors, as the worker's
              staging does (for reference, no target: it shows what fresh allocations add when
              the allocator cannot reuse freed pages);
  uni / mp / ray
              `engine.update_weights(state, bucket_bytes=...)` on an engine with that executor and
              one worker (mp once per `--mp-bucket-mib`), NaN/inf check included (the default);
  uni no check
              the same push on the uni engine with `check_finite=False`: the side-by-side cost of
              the finite check;
  naive       `safetensors.torch.save_file(state)` to a folder, then
              `SD3Transformer2DModel.from_pretrained(folder)`: what a trainer does without a
              hot-swap API (and it would still have to put the loaded model into the engine).

Before every round the trainer's copy is perturbed (so every push changes the weights), and after
every push (outside the timed region) `engine.weights_checksum()` must equal
`rollout.weights.checksum(state)`. Rounds are interleaved (each runs every mode, in a rotated
order), warmup rounds are discarded, medians are reported with GB/s (1e9 bytes), the fraction of
the copy floor's bandwidth and the speedup over the naive path. Targets: uni >= 50 % of the copy
bandwidth, mp >= 25 %, every backend >= 5x faster than naive. Timers in the worker and around the
executor's `collective_rpc` split every engine push into the engine's checks, the stage_weights
RPCs' transport (wire format, shared memory or object store, hops), the worker's staging copy, and
apply/commit; the report gives each piece's median.

(Past the ~400-line guide on purpose: the modes, the push timers and the report share the rounds
and the statistics, and a benchmark reads best as one script.)

    python -m benchmarks.weight_sync                          # uni, mp, ray; 1 + 7 rounds
    python -m benchmarks.weight_sync --backends uni mp --mp-bucket-mib 16 64 512
    python -m benchmarks.weight_sync --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import (
    install_timers,
    interleaved_rounds,
    json_args,
    per_round_ratio,
    remove_timers,
    spread,
    take_timings,
    timed_call,
    write_json,
)
from rollout import EngineConfig, RolloutEngine
from rollout.pipelines.tiny import TinySD3Sizes, build_tiny_sd3
from rollout.weights import base_state, checksum

BACKENDS = ("uni", "mp", "ray")
MIB = 2**20
NO_CHECK_MODE = "uni no check"  # check_finite=False, beside the uni mode that checks
# The project's targets.
TARGET_COPY_FRACTION = {"uni": 0.50, "mp": 0.25}  # of the copy floor's GB/s
TARGET_SPEEDUP_VS_NAIVE = 5.0  # every backend


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.weight_sync",
        description=__doc__.split("\n\n")[0]
        + " Prints a table of seconds, GB/s, the fraction of a plain torch copy's bandwidth and the"
        " speedup over save + from_pretrained, with the ratios against the project's targets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = parser.add_argument_group("what to run")
    run.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="executors to measure")
    run.add_argument("--repeats", type=int, default=7, help="timed rounds; each runs every mode once")
    run.add_argument("--warmup", type=int, default=1, help="untimed rounds first (allocator, first calls)")
    run.add_argument(
        "--bucket-mib", type=int, default=512, help="bucket_bytes of update_weights for uni and ray, in MiB"
    )
    run.add_argument(
        "--mp-bucket-mib",
        type=int,
        nargs="+",
        default=[64, 512],
        help="bucket sizes to try on mp, in MiB (one mode each)",
    )
    run.add_argument(
        "--verify",
        choices=("every", "first"),
        default="every",
        help="compare checksums after every push, or only after each mode's first one",
    )
    run.add_argument("--no-naive", action="store_true", help="skip the save_file + from_pretrained mode")
    run.add_argument("--no-breakdown", action="store_true", help="skip the timers that split engine pushes")
    run.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of this process (copy floor, clone, naive and the uni worker run here) and of each"
        " mp/ray worker. Copies are memory-bound; with more threads than idle cores, every per-tensor copy"
        " waits for a descheduled thread (20x slower pushes seen on 2 busy cores)",
    )
    run.add_argument("--ray-cpus", type=int, default=2, help="num_cpus of the local ray.init()")
    run.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    sizes = parser.add_argument_group(
        "model sizes", "the SD3 transformer's shape (the defaults give ~219 MB of float32); VAE and CLIPs stay tiny"
    )
    sizes.add_argument("--num-layers", type=int, default=6, help="transformer blocks")
    sizes.add_argument("--num-heads", type=int, default=8, help="attention heads")
    sizes.add_argument("--head-dim", type=int, default=64, help="width of one head (hidden = heads x head-dim)")
    args = parser.parse_args(argv)
    positive = ("repeats", "bucket_mib", "threads", "ray_cpus", "num_layers", "num_heads", "head_dim")
    bad = [f"--{name.replace('_', '-')}" for name in positive if getattr(args, name) < 1]
    bad += ["--mp-bucket-mib"] if min(args.mp_bucket_mib) < 1 else []
    if bad or args.warmup < 0:
        parser.error(f"{', '.join(bad) or 'these options'} must be >= 1 (and --warmup >= 0)")
    return args


def benchmark_sizes(args: argparse.Namespace) -> TinySD3Sizes:
    return TinySD3Sizes(
        num_layers=args.num_layers, num_attention_heads=args.num_heads, attention_head_dim=args.head_dim
    )


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# The modes. Each `make_*` does the untimed setup and returns a function that runs one push.


def make_copy_run(state: dict[str, torch.Tensor]) -> Callable[[], None]:
    sources = [t.detach() for t in state.values()]
    targets = [torch.empty_like(t) for t in sources]
    for target in targets:
        target.zero_()  # touch every page now, so the timed copies pay no page faults

    def run() -> None:
        with torch.no_grad():
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source)

    return run


def make_clone_run(state: dict[str, torch.Tensor]) -> Callable[[], None]:
    sources = [t.detach() for t in state.values()]

    def run() -> None:
        clones = [source.clone() for source in sources]
        del clones

    return run


def make_engine_run(
    engine: RolloutEngine, state: dict[str, torch.Tensor], bucket_bytes: int, check_finite: bool = True
) -> Callable[[], None]:
    def run() -> None:
        engine.update_weights(state, bucket_bytes=bucket_bytes, check_finite=check_finite)

    return run


def make_naive_run(trainer, state: dict[str, torch.Tensor], folder: Path) -> Callable[[], None]:
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    trainer.save_config(folder)  # config.json, written once: only the weights change between pushes
    weights_file = folder / "diffusion_pytorch_model.safetensors"

    def run() -> None:
        save_file({name: tensor.detach() for name, tensor in state.items()}, weights_file)
        loaded = SD3Transformer2DModel.from_pretrained(folder, local_files_only=True)
        del loaded

    return run


# Where a push spends its time, measured on every timed push: timers in the worker (installed
# through collective_rpc, so they run in the worker's thread or process whatever the executor;
# instance attributes shadow `StagedUpdates`' methods while installed) and a wrapper on the
# engine's executor's `collective_rpc` (an instance attribute shadows the method), which times each
# RPC as the engine sees it.

_WORKER_PIECES = (("stage", "updates.stage"), ("apply", "updates.apply"), ("commit", "updates.commit"))
BREAKDOWN_ROWS = (
    "engine: name/shape/dtype checks, bucketing",
    "stage_weights rpcs: wire format, transport, hops",
    "worker: stage (copy each bucket in)",
    "apply + commit rpcs: round trips",
    "worker: apply (swap storages in)",
    "worker: commit (drop the old weights)",
)


@dataclass
class PushTimer:
    """Times one engine's pushes piece by piece: `reset()` before a push, `take(wall_s)` after it."""

    engine: RolloutEngine
    rpc_seconds: dict[str, float] = field(default_factory=dict)
    rpc_calls: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        executor = self.engine.executor
        inner = executor.collective_rpc

        def collective_rpc(method, *args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(method, *args, **kwargs)
            finally:
                name = method if isinstance(method, str) else method.__name__
                self.rpc_seconds[name] = self.rpc_seconds.get(name, 0.0) + time.perf_counter() - start
                self.rpc_calls[name] = self.rpc_calls.get(name, 0) + 1

        executor.collective_rpc = collective_rpc
        self.engine.collective_rpc(install_timers, args=(_WORKER_PIECES,))

    def reset(self) -> None:
        self.engine.collective_rpc(take_timings)
        self.rpc_seconds, self.rpc_calls = {}, {}

    def take(self, wall_s: float) -> dict[str, float]:
        """The rows (seconds) of the push that took `wall_s`, plus its number of buckets."""
        rpc, buckets = self.rpc_seconds, self.rpc_calls.get("stage_weights", 0)
        worker = {name: sum(seconds) for name, seconds in self.engine.collective_rpc(take_timings)[0].items()}
        stage_rpc = rpc.get("stage_weights", 0.0)
        swap_rpc = rpc.get("apply_staged_weights", 0.0) + rpc.get("commit_weights", 0.0)
        values = (
            wall_s - sum(rpc.values()),
            stage_rpc - worker["stage"],
            worker["stage"],
            swap_rpc - worker["apply"] - worker["commit"],
            worker["apply"],
            worker["commit"],
        )
        return dict(zip(BREAKDOWN_ROWS, values, strict=True)) | {"buckets": buckets}

    def remove(self) -> None:
        self.engine.collective_rpc(remove_timers)
        del self.engine.executor.collective_rpc


# Running.


def perturb(trainer) -> None:
    """Change every floating-point weight a little, in place (as an optimizer step would)."""
    with torch.no_grad():
        for tensor in base_state(trainer).values():
            if tensor.is_floating_point():
                tensor.add_(1e-4)


def time_rounds(
    runs: dict[str, Callable[[], None]],
    engines: dict[str, RolloutEngine],
    timers: dict[str, PushTimer],
    trainer,
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]], int]:
    """Seconds per push for each mode (round r runs the modes rotated by r), the breakdown rows of
    every timed engine push, and the number of checksum comparisons made."""
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    pieces: dict[str, list[dict[str, float]]] = {mode: [] for mode in timers}
    verified = 0
    for round_ in interleaved_rounds(runs, args.warmup, args.repeats):
        perturb(trainer)
        expected = checksum(base_state(trainer))
        for mode in round_.order:
            if mode in timers:
                timers[mode].reset()
            _, elapsed = timed_call(runs[mode])
            rows = timers[mode].take(elapsed) if mode in timers else None
            note = ""
            if mode in engines and (args.verify == "every" or round_.index == 0):
                got = engines[mode].weights_checksum()
                if got != expected:
                    raise AssertionError(f"{mode}: engine checksum {got[:12]} != pushed state's {expected[:12]}")
                verified += 1
                note = f"  checksum ok {got[:12]}"
            if round_.timed:
                times[mode].append(elapsed)
                if rows is not None:
                    pieces[mode].append(rows)
            print(f"  [{round_.tag}] {mode:<16} {elapsed:7.3f} s{note}", flush=True)
    return times, pieces, verified


def target_of(mode: str) -> tuple[str, float | None]:
    backend = mode.split()[0]
    if backend in TARGET_COPY_FRACTION:
        return backend, TARGET_COPY_FRACTION[backend]
    return backend, None


def summarize(times: dict[str, list[float]], nbytes: int) -> dict[str, dict]:
    """Per mode: median/min/max seconds, GB/s of the median, and two ratios, each from the medians
    (the headline, which the targets use) and as the median of per-round ratios (pushes of one round
    are seconds apart, so they share the machine's load)."""
    summary = {
        mode: {
            **spread(values),
            "gb_per_s": nbytes / 1e9 / statistics.median(values),
            "times_s": values,
        }
        for mode, values in times.items()
    }
    floor = times["copy floor"]
    naive = times.get("naive")
    for mode, row in summary.items():
        row["copy_fraction"] = statistics.median(floor) / row["median_s"]
        row["copy_fraction_per_round"] = per_round_ratio(floor, times[mode])
        row["speedup_vs_naive"] = statistics.median(naive) / row["median_s"] if naive else None
        row["speedup_vs_naive_per_round"] = per_round_ratio(naive, times[mode]) if naive else None
    return summary


def targets_met(summary: dict[str, dict]) -> dict[str, dict[str, bool]]:
    verdicts = {}
    for mode, row in summary.items():
        backend, fraction = target_of(mode)
        if backend not in BACKENDS:
            continue
        verdicts[mode] = {}
        if fraction is not None:
            verdicts[mode]["copy_fraction"] = row["copy_fraction"] >= fraction
        if row["speedup_vs_naive"] is not None:
            verdicts[mode]["speedup_vs_naive"] = row["speedup_vs_naive"] >= TARGET_SPEEDUP_VS_NAIVE
    return verdicts


def print_report(summary: dict[str, dict], verdicts: dict, breakdowns: dict[str, dict], nbytes: int) -> None:
    print(
        f"\npushing {nbytes / 1e6:.1f} MB; % copy = the copy floor's time / this mode's, x naive = the naive"
        " path's time / this mode's,\nboth from the medians and as the median of per-round ratios; targets on"
        " the medians"
    )
    header = (
        f"{'mode':<16} {'median s':>9} {'min s':>7} {'max s':>7} {'GB/s':>6} {'% copy':>7} {'round':>6}"
        f" {'x naive':>8} {'round':>6}   targets"
    )
    print(header)
    print("-" * (len(header) + 44))
    for mode, row in summary.items():
        if row["speedup_vs_naive"] is None:
            speedup = f"{'':>8} {'':>6}"
        else:
            speedup = f"{row['speedup_vs_naive']:>8.1f} {row['speedup_vs_naive_per_round']:>6.1f}"
        notes = []
        _, fraction = target_of(mode)
        if fraction is not None:
            ok = verdicts[mode]["copy_fraction"]
            notes.append(f">= {100 * fraction:.0f} % copy: {'met' if ok else 'MISSED'}")
        if "speedup_vs_naive" in verdicts.get(mode, {}):
            ok = verdicts[mode]["speedup_vs_naive"]
            notes.append(f">= {TARGET_SPEEDUP_VS_NAIVE:.0f}x naive: {'met' if ok else 'MISSED'}")
        print(
            f"{mode:<16} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {row['max_s']:>7.3f} {row['gb_per_s']:>6.2f}"
            f" {100 * row['copy_fraction']:>6.1f}% {100 * row['copy_fraction_per_round']:>5.1f}% {speedup}"
            f"   {'; '.join(notes)}"
        )
    if not breakdowns:
        return
    print("\nwhere an engine push spends its time (median seconds of each piece over the timed pushes;")
    print("worker pieces are timed in the worker, rpcs as the engine sees them, the engine row is the rest, +-1 ms)")
    modes = list(breakdowns)
    header = f"{'piece':<50}" + "".join(f" {mode:>16}" for mode in modes)
    print(header)
    print("-" * len(header))
    for name in BREAKDOWN_ROWS:
        print(f"{name:<50}" + "".join(f" {breakdowns[mode]['rows'][name]:>16.3f}" for mode in modes))
    print(f"{'push wall (median)':<50}" + "".join(f" {summary[mode]['median_s']:>16.3f}" for mode in modes))
    print(f"{'buckets per push':<50}" + "".join(f" {breakdowns[mode]['buckets']:>16d}" for mode in modes))


def finite_check_cost(summary: dict[str, dict], bucket_mib: int) -> dict[str, float] | None:
    """What the NaN/inf check adds to a uni push: median seconds with it minus without, from the
    medians and as the median of per-round differences; printed, and None without both modes."""
    checked = summary.get(f"uni ({bucket_mib} MiB)")
    unchecked = summary.get(NO_CHECK_MODE)
    if checked is None or unchecked is None:
        return None
    per_round = statistics.median(a - b for a, b in zip(checked["times_s"], unchecked["times_s"], strict=True))
    cost = {
        "seconds": checked["median_s"] - unchecked["median_s"],
        "seconds_per_round": per_round,
        "fraction_of_push": per_round / checked["median_s"],
    }
    print(
        f"\nthe NaN/inf check (check_finite, on by default) adds {1e3 * cost['seconds']:.1f} ms to a uni push "
        f"({1e3 * per_round:.1f} ms as the median per-round difference, {100 * cost['fraction_of_push']:.0f} % of "
        "the checked push)"
    )
    return cost


def summarize_breakdowns(pieces: dict[str, list[dict[str, float]]]) -> dict[str, dict]:
    return {
        mode: {
            "rows": {name: statistics.median(p[name] for p in pushes) for name in BREAKDOWN_ROWS},
            "buckets": pushes[0]["buckets"],
        }
        for mode, pushes in pieces.items()
        if pushes
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from diffusers import SD3Transformer2DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    backends = [b for b in BACKENDS if b in args.backends]
    sizes = benchmark_sizes(args)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the uni worker runs in this process
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()} (here and per worker), cpus {os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.2f} (other processes share the machine if this is high)"
    )
    print(f"rounds {args.warmup} warmup + {args.repeats} timed, backends {backends}, sizes: {sizes}")
    ray = None
    engines: dict[str, RolloutEngine] = {}
    timers: dict[str, PushTimer] = {}
    by_engine: dict[str, PushTimer] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
            folder = Path(tmp) / "pipeline"
            start = time.perf_counter()
            build_tiny_sd3(folder, seed=0, sizes=sizes)
            print(f"built and saved the pipeline in {time.perf_counter() - start:.2f} s")
            trainer = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
            original = checksum(base_state(trainer))  # what every engine loads
            state = base_state(trainer)
            nbytes = state_bytes(state)
            params = sum(t.numel() for t in state.values())
            print(
                f"transformer: {params / 1e6:.2f}M parameters, {len(state)} tensors, {nbytes / 1e6:.1f} MB "
                f"({', '.join(sorted({str(t.dtype).removeprefix('torch.') for t in state.values()}))})"
            )
            if "ray" in backends:
                import ray

                ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
            for backend in backends:
                start = time.perf_counter()
                engines[backend] = RolloutEngine(
                    EngineConfig(model=str(folder), executor=backend, num_workers=1, threads_per_worker=args.threads)
                )
                print(f"  started {backend:<4} in {time.perf_counter() - start:6.2f} s", flush=True)
            # The modes hold `state`: the trainer's tensors, which `perturb` changes in place.
            runs: dict[str, Callable[[], None]] = {
                "copy floor": make_copy_run(state),
                "clone": make_clone_run(state),
            }
            mode_engines: dict[str, RolloutEngine] = {}
            for backend in backends:
                buckets = args.mp_bucket_mib if backend == "mp" else [args.bucket_mib]
                for mib in buckets:
                    mode = f"{backend} ({mib} MiB)"
                    runs[mode] = make_engine_run(engines[backend], state, mib * MIB)
                    mode_engines[mode] = engines[backend]
            if "uni" in engines:
                runs[NO_CHECK_MODE] = make_engine_run(engines["uni"], state, args.bucket_mib * MIB, check_finite=False)
                mode_engines[NO_CHECK_MODE] = engines["uni"]
            if not args.no_naive:
                runs["naive"] = make_naive_run(trainer, state, Path(tmp) / "naive")
            perturb(trainer)
            if checksum(state) == original:
                raise AssertionError("perturbing the trainer's copy did not change it")
            if not args.no_breakdown:
                by_engine = {backend: PushTimer(engine) for backend, engine in engines.items()}
                timers = {mode: by_engine[mode.split()[0]] for mode in mode_engines}
            times, pieces, verified = time_rounds(runs, mode_engines, timers, trainer, args)
            print(f"  {verified} checksum comparisons, all equal; load average now {os.getloadavg()[0]:.2f}")
            for timer in by_engine.values():
                timer.remove()
    finally:
        for engine in engines.values():
            engine.shutdown()
        if ray is not None:
            ray.shutdown()
        torch.set_num_threads(previous_threads)
    summary = summarize(times, nbytes)
    verdicts = targets_met(summary)
    breakdowns = summarize_breakdowns(pieces)
    print_report(summary, verdicts, breakdowns, nbytes)
    check_cost = finite_check_cost(summary, args.bucket_mib)
    result = {
        "args": json_args(args),
        "torch_version": torch.__version__,
        "torch_threads": args.threads,
        "transformer_parameters": params,
        "pushed_bytes": nbytes,
        "checksums_verified": verified,
        "modes": summary,
        "targets_met": verdicts,
        "breakdown": breakdowns,
        "finite_check": check_cost,
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
