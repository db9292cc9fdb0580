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
`rollout.weights.checksum(state)`. Medians are reported with GB/s (1e9 bytes), the fraction of the
copy floor's bandwidth and the speedup over the naive path, from the medians (the targets use
these) and as the median of per-round ratios. Targets: uni >= 50 % of the copy bandwidth, mp >=
25 %, every backend >= 5x faster than naive.

The engine's step observer (the time of every RPC as the engine sees it) and worker timers on
`StagedUpdates` (stage, apply, commit) split every engine push into the engine's checks, the
stage_weights RPCs' transport (wire format, shared memory or object store, hops), the worker's
staging copy, and apply/commit; the report gives each piece's median.

--threads sets torch's threads here (copy floor, clone, naive and the uni worker run in this
process) and in each mp/ray worker. Copies are memory-bound; with more threads than idle cores,
every per-tensor copy waits for a descheduled thread (20x slower pushes seen on 2 busy cores).

    python -m benchmarks.weight_sync                          # uni, mp, ray; 1 + 7 rounds
    python -m benchmarks.weight_sync --backends uni mp --mp-bucket-mib 16 64 512
    python -m benchmarks.weight_sync --json out.json
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.worker_timers import install_timers, remove_timers, take_timings
from rollout import EngineConfig, RolloutEngine
from rollout.pipelines.tiny import TinySD3Sizes, build_tiny_sd3
from rollout.step_report import StepReport
from rollout.weights import base_state, checksum

BACKENDS = ("uni", "mp", "ray")
MIB = 2**20
NO_CHECK_MODE = "uni no check"  # check_finite=False, beside the uni mode that checks
# The project's targets.
TARGET_COPY_PERCENT = {"uni": 50.0, "mp": 25.0}  # of the copy floor's GB/s
TARGET_SPEEDUP_VS_NAIVE = 5.0  # every backend


def build_parser():
    parser = harness.parser("weight_sync", __doc__, repeats=7, warmup=1, threads=1)
    run = parser.add_argument_group("what to run")
    run.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="executors to measure")
    run.add_argument(
        "--bucket-mib",
        type=harness.positive_int,
        default=512,
        help="bucket_bytes of update_weights for uni and ray, in MiB",
    )
    run.add_argument(
        "--mp-bucket-mib",
        type=harness.positive_int,
        nargs="+",
        default=[64, 512],
        help="bucket sizes to try on mp, in MiB (one mode each)",
    )
    run.add_argument(
        "--verify",
        choices=("every", "first"),
        default="every",
        help="compare checksums after every push, or only in the first round",
    )
    run.add_argument("--no-naive", action="store_true", help="skip the save_file + from_pretrained mode")
    run.add_argument("--no-breakdown", action="store_true", help="skip the timers that split engine pushes")
    run.add_argument("--ray-cpus", type=harness.positive_int, default=2, help="num_cpus of the local ray.init()")
    sizes = parser.add_argument_group(
        "model sizes", "the SD3 transformer's shape (the defaults give ~219 MB of float32); VAE and CLIPs stay tiny"
    )
    sizes.add_argument("--num-layers", type=harness.positive_int, default=6, help="transformer blocks")
    sizes.add_argument("--num-heads", type=harness.positive_int, default=8, help="attention heads")
    sizes.add_argument(
        "--head-dim", type=harness.positive_int, default=64, help="width of one head (hidden = heads x head-dim)"
    )
    return parser


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


# Where a push spends its time, measured on every timed push: worker timers on `StagedUpdates`
# (benchmarks.worker_timers) and the engine's step observer, which reports every RPC's seconds as
# the engine sees them. Each piece is (key, row label).

PIECES = (
    ("engine", "engine: name/shape/dtype checks, bucketing"),
    ("stage_rpcs", "stage_weights rpcs: wire format, transport, hops"),
    ("stage", "worker: stage (copy each bucket in)"),
    ("swap_rpcs", "apply + commit rpcs: round trips"),
    ("apply", "worker: apply (swap storages in)"),
    ("commit", "worker: commit (drop the old weights)"),
)
_WORKER_PIECES = (("stage", "updates.stage"), ("apply", "updates.apply"), ("commit", "updates.commit"))


@dataclass
class PushTimer:
    """Times one engine's pushes piece by piece: `reset()` before a push, `take(wall_s)` after it."""

    engine: RolloutEngine
    rpc_seconds: dict[str, float] = field(default_factory=dict)
    rpc_calls: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.remove_observer = self.engine.add_step_observer(self._observe)
        self.engine.collective_rpc(install_timers, args=(_WORKER_PIECES,))

    def _observe(self, report: StepReport) -> None:
        if report.kind == "rpc":
            self.rpc_seconds[report.name] = self.rpc_seconds.get(report.name, 0.0) + report.wall_s
            self.rpc_calls[report.name] = self.rpc_calls.get(report.name, 0) + 1

    def reset(self) -> None:
        self.engine.collective_rpc(take_timings)
        self.rpc_seconds, self.rpc_calls = {}, {}

    def take(self, wall_s: float) -> dict[str, float]:
        """The pieces (seconds) of the push that took `wall_s`, plus its number of buckets."""
        rpc, buckets = dict(self.rpc_seconds), self.rpc_calls.get("stage_weights", 0)
        worker = {name: sum(seconds) for name, seconds in self.engine.collective_rpc(take_timings)[0].items()}
        swap_rpcs = rpc.get("apply_staged_weights", 0.0) + rpc.get("commit_weights", 0.0)
        return {
            "engine": wall_s - sum(rpc.values()),
            "stage_rpcs": rpc.get("stage_weights", 0.0) - worker["stage"],
            "stage": worker["stage"],
            "swap_rpcs": swap_rpcs - worker["apply"] - worker["commit"],
            "apply": worker["apply"],
            "commit": worker["commit"],
            "buckets": buckets,
        }

    def remove(self) -> None:
        self.engine.collective_rpc(remove_timers)
        self.remove_observer()


# Running.


def perturb(trainer) -> None:
    """Change every floating-point weight a little, in place (as an optimizer step would)."""
    with torch.no_grad():
        for tensor in base_state(trainer).values():
            if tensor.is_floating_point():
                tensor.add_(1e-4)


@dataclass
class Pushes:
    """The trainer's copy, perturbed before each round's first mode, and the checksum comparisons."""

    trainer: object
    verify: str  # "every" or "first"
    round_index: int = -1
    expected: str = ""
    verified: int = 0

    def mode(self, name: str, run: Callable[[], None], engine=None, timer: PushTimer | None = None):
        """A mode for `harness.run_rounds`: the push's seconds (and its pieces, with a `timer`),
        checked against the trainer's checksum afterwards when it went to an `engine`."""

        def measured(round_: harness.Round) -> dict[str, float]:
            if round_.index != self.round_index:
                perturb(self.trainer)
                self.round_index, self.expected = round_.index, checksum(base_state(self.trainer))
            if timer is not None:
                timer.reset()
            _, seconds = harness.timed_call(run)
            pieces = timer.take(seconds) if timer is not None else {}
            if engine is not None and (self.verify == "every" or round_.index == 0):
                got = engine.weights_checksum()
                if got != self.expected:
                    raise AssertionError(f"{name}: engine checksum {got[:12]} != pushed state's {self.expected[:12]}")
                self.verified += 1
            return {"s": seconds} | pieces

        return measured


def summarize(samples: dict[str, dict[str, list[float]]], nbytes: int) -> dict[str, dict]:
    """Per mode: the seconds' statistics, GB/s of the median, and two ratios, each from the medians
    (the headline, which the targets use) and as the median of per-round ratios."""
    times = {mode: measured["s"] for mode, measured in samples.items()}
    floor, naive = times["copy floor"], times.get("naive")
    summary = {}
    for mode, values in times.items():
        stats = harness.Stats.of(values)
        summary[mode] = {
            "seconds": stats.to_json(),
            "gb_per_s": nbytes / 1e9 / stats.median,
            "copy_fraction": harness.Stats.of(floor).median / stats.median,
            "copy_fraction_per_round": harness.per_round_ratio(floor, values),
            "speedup_vs_naive": harness.Stats.of(naive).median / stats.median if naive else None,
            "speedup_vs_naive_per_round": harness.per_round_ratio(naive, values) if naive else None,
        }
    return summary


def report_modes(report: harness.Report, summary: dict[str, dict], nbytes: int) -> None:
    rows = []
    for mode, row in summary.items():
        seconds, naive = row["seconds"], row["speedup_vs_naive"] is not None
        rows.append(
            [mode, seconds["median"], seconds["min"], seconds["max"], row["gb_per_s"]]
            + [100 * row["copy_fraction"], 100 * row["copy_fraction_per_round"]]
            + ([row["speedup_vs_naive"], row["speedup_vs_naive_per_round"]] if naive else ["", ""])
        )
        backend = mode.split()[0]
        if backend in TARGET_COPY_PERCENT:
            goal = TARGET_COPY_PERCENT[backend]
            report.check(harness.Target(f"{mode}: % of the copy floor's GB/s", rows[-1][5], ">=", goal))
        if backend in BACKENDS and naive:
            report.check(harness.Target(f"{mode}: x faster than naive", row["speedup_vs_naive"], ">=", 5.0))
    report.table(
        f"pushing {nbytes / 1e6:.1f} MB",
        ["mode", "median s", "min s", "max s", "GB/s", "% copy", "round", "x naive", "round"],
        rows,
        note="% copy = the copy floor's time / this mode's, x naive = the naive path's time / this mode's, both from"
        " the medians and (round) as the median of per-round ratios; targets on the medians",
    )


def report_breakdown(report: harness.Report, samples: dict, summary: dict, modes: list[str]) -> dict[str, dict]:
    medians = {mode: {key: harness.Stats.of(samples[mode][key]).median for key, _ in PIECES} for mode in modes}
    rows = [[label, *(medians[mode][key] for mode in modes)] for key, label in PIECES]
    rows.append(["push wall (median)", *(summary[mode]["seconds"]["median"] for mode in modes)])
    rows.append(["buckets per push", *(int(samples[mode]["buckets"][0]) for mode in modes)])
    report.table(
        "where an engine push spends its time (median seconds of each piece over the timed pushes)",
        ["piece", *modes],
        rows,
        note="worker pieces are timed in the worker, rpcs as the engine sees them, the engine row is the rest, +-1 ms",
    )
    return {mode: {"seconds": medians[mode], "buckets": int(samples[mode]["buckets"][0])} for mode in modes}


def finite_check_cost(report: harness.Report, samples: dict, bucket_mib: int) -> dict[str, float] | None:
    """What the NaN/inf check adds to a uni push: median seconds with it minus without, from the
    medians and as the median of per-round differences; None without both modes."""
    checked, unchecked = samples.get(f"uni ({bucket_mib} MiB)"), samples.get(NO_CHECK_MODE)
    if checked is None or unchecked is None:
        return None
    checked_s = harness.Stats.of(checked["s"]).median
    per_round = harness.Stats.of(a - b for a, b in zip(checked["s"], unchecked["s"], strict=True)).median
    cost = {
        "seconds": checked_s - harness.Stats.of(unchecked["s"]).median,
        "seconds_per_round": per_round,
        "fraction_of_push": per_round / checked_s,
    }
    report.note(
        f"the NaN/inf check (check_finite, on by default) adds {1e3 * cost['seconds']:.1f} ms to a uni push "
        f"({1e3 * per_round:.1f} ms as the median per-round difference, {100 * cost['fraction_of_push']:.0f} % of "
        "the checked push)"
    )
    return cost


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from diffusers import SD3Transformer2DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    backends = [b for b in BACKENDS if b in args.backends]
    sizes = TinySD3Sizes(
        num_layers=args.num_layers, num_attention_heads=args.num_heads, attention_head_dim=args.head_dim
    )
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the uni worker runs in this process
    report = harness.Report("weight_sync", args, __doc__, argv)
    load_before = os.getloadavg()[0]
    ray = None
    engines: dict[str, RolloutEngine] = {}
    by_engine: dict[str, PushTimer] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
            folder = Path(tmp) / "pipeline"
            build_tiny_sd3(folder, seed=0, sizes=sizes)
            trainer = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
            original = checksum(base_state(trainer))  # what every engine loads
            state = base_state(trainer)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            params = sum(t.numel() for t in state.values())
            report.note(
                f"transformer: {params / 1e6:.2f}M parameters, {len(state)} tensors, {nbytes / 1e6:.1f} MB "
                f"({', '.join(sorted({str(t.dtype).removeprefix('torch.') for t in state.values()}))}); {sizes}"
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
            if not args.no_breakdown:
                by_engine = {backend: PushTimer(engine) for backend, engine in engines.items()}
            # The modes hold `state`: the trainer's tensors, which `perturb` changes in place.
            pushes = Pushes(trainer, args.verify)
            modes = {
                "copy floor": pushes.mode("copy floor", make_copy_run(state)),
                "clone": pushes.mode("clone", make_clone_run(state)),
            }
            engine_modes = []
            for backend in backends:
                for mib in args.mp_bucket_mib if backend == "mp" else [args.bucket_mib]:
                    engine_modes.append((f"{backend} ({mib} MiB)", backend, mib * MIB, True))
            if "uni" in engines:
                engine_modes.append((NO_CHECK_MODE, "uni", args.bucket_mib * MIB, False))
            for mode, backend, bucket_bytes, check in engine_modes:
                run = functools.partial(
                    engines[backend].update_weights, state, bucket_bytes=bucket_bytes, check_finite=check
                )
                modes[mode] = pushes.mode(mode, run, engines[backend], by_engine.get(backend))
            if not args.no_naive:
                modes["naive"] = pushes.mode("naive", make_naive_run(trainer, state, Path(tmp) / "naive"))
            samples = harness.run_rounds(modes, args.warmup, args.repeats)
            if checksum(state) == original:
                raise AssertionError("perturbing the trainer's copy did not change it")
            for timer in by_engine.values():
                timer.remove()
    finally:
        for engine in engines.values():
            engine.shutdown()
        if ray is not None:
            ray.shutdown()
        torch.set_num_threads(previous_threads)
    report.note(
        f"{pushes.verified} checksum comparisons, all equal; load average {load_before:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end (other processes share the machine if these are high)"
    )
    summary = summarize(samples, nbytes)
    report_modes(report, summary, nbytes)
    breakdowns = report_breakdown(report, samples, summary, [m for m, *_ in engine_modes]) if by_engine else {}
    report.results = {
        "transformer_parameters": params,
        "pushed_bytes": nbytes,
        "checksums_verified": pushes.verified,
        "modes": summary,
        "breakdown": breakdowns,
        "finite_check": finite_check_cost(report, samples, args.bucket_mib),
    }
    return report.finish()


if __name__ == "__main__":
    main()
