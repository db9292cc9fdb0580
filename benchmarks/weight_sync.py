"""Weight sync: seconds and GB/s of pushing a full transformer into the engine, per backend.

Builds an SD3 pipeline (random weights; a transformer of a few hundred MB of float32), loads the
transformer again as the trainer's copy, and pushes the same bytes (every tensor of `base_state`):

  copy floor      `dst.copy_(src)` into tensors allocated (and touched) beforehand: the memory
                  bandwidth any push is bounded by;
  clone           `src.clone()`, as the worker's staging does (reference: what fresh allocations add);
  uni / mp / ray  `engine.update_weights(state, bucket_bytes=...)` with that executor and one worker
                  (mp once per `--mp-bucket-mib`), NaN/inf check included (the default);
  uni no check    the same on uni with `check_finite=False`: the cost of the finite check;
  naive           `safetensors.torch.save_file(state)`, then `SD3Transformer2DModel.from_pretrained`:
                  what a trainer does without a hot-swap API.

Every round first perturbs the trainer's copy; after every push (untimed) `engine.weights_checksum()`
must equal `rollout.weights.state.checksum(state)`. The step observer (RPCs) and worker timers on
`StagedUpdates` split every engine push into the engine's part (spec checks, the one write of each
bucket into the workers' staging buffers with the NaN/inf check), the reserve and stage RPCs, the
worker's staging (views), and apply/commit; `pause` is the apply and commit RPCs, all that
generation waits for when a push streams beside it. Targets (issue 53, on the medians): uni >= 70 %
of the copy floor's GB/s, mp and ray >= 50 %, every backend >= 5x faster than naive; with
`--device cuda` (`make bench-gpu`), >= 8 GB/s per replica.

--threads sets torch's threads here (copy floor, clone, naive and the uni worker run in this
process) and in each mp/ray worker. Copies are memory-bound; with more threads than idle cores,
every per-tensor copy waits for a descheduled thread (20x slower pushes seen on 2 busy cores).

    python -m benchmarks.weight_sync                          # uni, mp, ray; 1 + 7 rounds
    python -m benchmarks.weight_sync --backends uni mp --mp-bucket-mib 16 64 512
    python -m benchmarks.weight_sync --json out.json
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.worker_timers import install_timers, remove_timers, take_timings
from rollout import EngineConfig, RolloutEngine
from rollout.pipelines.tiny import TinySD3Sizes, build_tiny_sd3
from rollout.weights.state import base_state, checksum

BACKENDS = ("uni", "mp", "ray")
MIB = 2**20
NO_CHECK_MODE = "uni no check"  # check_finite=False, beside the uni mode that checks
TARGET_COPY_PERCENT = {"uni": 70.0, "mp": 50.0, "ray": 50.0}  # of the copy floor's GB/s (issue 53)
TARGET_SPEEDUP_VS_NAIVE = 5.0  # every backend
# On a GPU (`--device cuda`, `make bench-gpu`): GB/s into each replica, verl's NCCL checkpoint
# engine's 8.25 GB/s per replica rounded down (issue 53).
TARGET_GPU_GB_PER_S = 8.0


def build_parser():
    parser = harness.parser("weight_sync", __doc__, repeats=7, warmup=1, threads=1, device="cpu")
    run = parser.add_argument_group("what to run")
    run.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="executors to measure")
    run.add_argument("--bucket-mib", type=harness.positive_int, default=512, help="bucket_bytes (MiB), uni and ray")
    run.add_argument(
        "--mp-bucket-mib", type=harness.positive_int, nargs="+", default=[64, 512], help="mp bucket sizes, a mode each"
    )
    run.add_argument("--verify", choices=("every", "first"), default="every", help="checksums: every push or round 1")
    run.add_argument("--no-naive", action="store_true", help="skip the save_file + from_pretrained mode")
    run.add_argument("--no-breakdown", action="store_true", help="skip the timers that split engine pushes")
    run.add_argument("--ray-cpus", type=harness.positive_int, default=2, help="num_cpus of the local ray.init()")
    sizes = parser.add_argument_group("model sizes", "the SD3 transformer's (~219 MB of float32 by default)")
    sizes.add_argument("--num-layers", type=harness.positive_int, default=6, help="transformer blocks")
    sizes.add_argument("--num-heads", type=harness.positive_int, default=8, help="attention heads")
    sizes.add_argument("--head-dim", type=harness.positive_int, default=64, help="width of one head")
    return parser


def make_copy_run(state: dict[str, torch.Tensor]) -> Callable[[], None]:
    sources = [t.detach() for t in state.values()]
    targets = [torch.empty_like(t).zero_() for t in sources]  # every page touched: no page faults when timed

    @torch.no_grad()
    def run() -> None:
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

    def run() -> None:
        save_file({key: t.detach() for key, t in state.items()}, folder / "diffusion_pytorch_model.safetensors")
        SD3Transformer2DModel.from_pretrained(folder, local_files_only=True)

    return run


# Where a push spends its time, on every timed push: (key, row label).
PIECES = (
    ("engine", "engine: spec checks, writing each bucket into the workers' staging (the copy, NaN/inf check)"),
    ("stage_rpcs", "reserve + stage rpcs: round trips (the worker takes views)"),
    ("stage", "worker: stage (views of each bucket)"),
    ("swap_rpcs", "apply + commit rpcs: round trips"),
    ("apply", "worker: apply (swap storages in)"),
    ("commit", "worker: commit (drop the old weights)"),
)
# The RPCs of the staging phase, and those that stage one bucket each.
_STAGING_RPCS = ("reserve_staging", "stage_weights_from_staging", "stage_weights_flat", "stage_weights")
_BUCKET_RPCS = ("stage_weights_from_staging", "stage_weights_flat", "stage_weights")
_WORKER_PIECES = (("stage", "updates.stage"), ("apply", "updates.apply"), ("commit", "updates.commit"))


class PushTimer:
    """Times one engine's pushes piece by piece: `reset()` before a push, `take(wall_s)` after it."""

    def __init__(self, engine: RolloutEngine):
        self.engine, self.rpcs = engine, []
        self.remove_observer = engine.add_step_observer(lambda r: self.rpcs.append(r) if r.kind == "rpc" else None)
        engine.collective_rpc(install_timers, args=(_WORKER_PIECES,))

    def reset(self) -> None:
        self.engine.collective_rpc(take_timings)
        self.rpcs = []

    def take(self, wall_s: float) -> dict[str, float]:
        """The pieces (seconds) of the push that took `wall_s`, plus its number of buckets."""
        worker = {name: sum(seconds) for name, seconds in self.engine.collective_rpc(take_timings)[0].items()}

        def rpcs(*names: str) -> float:
            return sum(report.wall_s for report in self.rpcs if report.name in names)

        return {
            "engine": wall_s - sum(report.wall_s for report in self.rpcs),
            "stage_rpcs": rpcs(*_STAGING_RPCS) - worker["stage"],
            "stage": worker["stage"],
            "swap_rpcs": rpcs("apply_staged_weights", "commit_weights") - worker["apply"] - worker["commit"],
            "apply": worker["apply"],
            "commit": worker["commit"],
            # What generation waits for: the swap alone (staging runs beside it in a streamed push).
            "pause": rpcs("apply_staged_weights", "commit_weights"),
            "buckets": sum(report.name in _BUCKET_RPCS for report in self.rpcs),
        }

    def remove(self) -> None:
        self.engine.collective_rpc(remove_timers)
        self.remove_observer()


@torch.no_grad()
def perturb(trainer) -> None:
    """Change every floating-point weight a little, in place (as an optimizer step would)."""
    for tensor in base_state(trainer).values():
        if tensor.is_floating_point():
            tensor.add_(1e-4)


@dataclass
class Pushes:
    """The trainer's copy, perturbed before each round's first mode, and the checksum comparisons."""

    trainer: object
    verify: str  # "every" or "first"
    device: str = "cpu"  # where the trainer's copy and the engines' models are
    round_index: int = -1
    expected: str = ""
    verified: int = 0

    def mode(self, run: Callable[[], None], engine=None, timer: PushTimer | None = None, name: str = ""):
        """A mode for `harness.run_rounds`: the push's seconds (and its pieces, with a `timer`),
        checked against the trainer's checksum afterwards when it went to an `engine`."""

        def measured(round_: harness.Round) -> dict[str, float]:
            if round_.index != self.round_index:
                perturb(self.trainer)
                self.round_index, self.expected = round_.index, checksum(base_state(self.trainer))
            if timer is not None:
                timer.reset()
            _, seconds = harness.timed_call(run, device=self.device)
            pieces = timer.take(seconds) if timer is not None else {}
            if engine is not None and (self.verify == "every" or round_.index == 0):
                got = engine.weights_checksum()
                if got != self.expected:
                    raise AssertionError(f"{name}: engine checksum {got[:12]} != pushed state's {self.expected[:12]}")
                self.verified += 1
            return {"s": seconds} | pieces

        return measured


def report_modes(
    report: harness.Report, samples: dict[str, dict[str, list[float]]], nbytes: int, device: str = "cpu"
) -> dict[str, dict]:
    """The pushes' table and targets; returns per mode the seconds' statistics, GB/s and the two ratios."""
    floor, naive = samples["copy floor"]["s"], samples.get("naive", {}).get("s")
    summary, rows = {}, []
    for mode, measured in samples.items():
        values = measured["s"]
        stats = harness.Stats.of(values)
        row = summary[mode] = {
            "seconds": stats.to_json(),
            "gb_per_s": nbytes / 1e9 / stats.median,
            "copy_fraction": harness.Stats.of(floor).median / stats.median,
            "copy_fraction_per_round": harness.per_round_ratio(floor, values),
            "speedup_vs_naive": harness.Stats.of(naive).median / stats.median if naive else None,
            "speedup_vs_naive_per_round": harness.per_round_ratio(naive, values) if naive else None,
        }
        if "pause" in measured:
            row["pause_seconds"] = harness.Stats.of(measured["pause"]).median
        copy_percent, speedup = 100 * row["copy_fraction"], row["speedup_vs_naive"]
        naive_cells = [speedup, row["speedup_vs_naive_per_round"]] if naive else ["", ""]
        pause = 1e3 * row["pause_seconds"] if "pause_seconds" in row else ""
        rows.append(
            [mode, stats.median, stats.min, stats.max, row["gb_per_s"], copy_percent]
            + [100 * row["copy_fraction_per_round"], *naive_cells, pause]
        )
        backend = mode.split()[0]
        if backend in TARGET_COPY_PERCENT:
            goal = TARGET_COPY_PERCENT[backend]
            report.check(harness.Target(f"{mode}: % of the copy floor's GB/s", copy_percent, ">=", goal))
        if backend in BACKENDS and naive:
            report.check(harness.Target(f"{mode}: x faster than naive", speedup, ">=", TARGET_SPEEDUP_VS_NAIVE))
        if backend in BACKENDS and device.startswith("cuda"):
            report.check(harness.Target(f"{mode}: GB/s per replica", row["gb_per_s"], ">=", TARGET_GPU_GB_PER_S))
    report.table(
        f"pushing {nbytes / 1e6:.1f} MB",
        ["mode", "median s", "min s", "max s", "GB/s", "% copy", "round", "x naive", "round", "pause ms"],
        rows,
        note="% copy = the copy floor's time / this mode's, x naive = the naive path's time / this mode's, both from"
        " the medians and (round) as the median of per-round ratios; targets on the medians; pause = the apply and"
        " commit rpcs (median), the only part of a push generation waits for when the push streams beside it",
    )
    return summary


def report_breakdown(report: harness.Report, samples: dict, summary: dict, modes: list[str]) -> dict[str, dict]:
    medians = {mode: {key: harness.Stats.of(samples[mode][key]).median for key, _ in PIECES} for mode in modes}
    buckets = {mode: int(samples[mode]["buckets"][0]) for mode in modes}
    report.table(
        "where an engine push spends its time (median seconds of each piece over the timed pushes)",
        ["piece", *modes],
        [[label, *(medians[mode][key] for mode in modes)] for key, label in PIECES]
        + [["push wall (median)", *(summary[mode]["seconds"]["median"] for mode in modes)]]
        + [["buckets per push", *buckets.values()]],
        note="worker pieces are timed in the worker, rpcs as the engine sees them, the engine row is the rest, +-1 ms",
    )
    return {mode: {"seconds": medians[mode], "buckets": buckets[mode]} for mode in modes}


def finite_check_cost(report: harness.Report, samples: dict, bucket_mib: int) -> dict[str, float] | None:
    """What the NaN/inf check adds to a uni push (None without both modes)."""
    checked, unchecked = samples.get(f"uni ({bucket_mib} MiB)"), samples.get(NO_CHECK_MODE)
    if checked is None or unchecked is None:
        return None
    checked_s = harness.Stats.of(checked["s"]).median
    seconds = checked_s - harness.Stats.of(unchecked["s"]).median
    per_round = harness.Stats.of(a - b for a, b in zip(checked["s"], unchecked["s"], strict=True)).median
    report.note(
        f"the NaN/inf check (check_finite, on by default) adds {1e3 * seconds:.1f} ms to a uni push "
        f"({1e3 * per_round:.1f} ms as the median per-round difference, {100 * per_round / checked_s:.0f} % of "
        "the checked push)"
    )
    return {"seconds": seconds, "seconds_per_round": per_round, "fraction_of_push": per_round / checked_s}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from diffusers import SD3Transformer2DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    backends = [b for b in BACKENDS if b in args.backends]
    sizes = TinySD3Sizes(
        num_layers=args.num_layers, num_attention_heads=args.num_heads, attention_head_dim=args.head_dim
    )
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(args.threads)  # the uni worker runs in this process
        report = harness.Report("weight_sync", args, __doc__, argv)
        load_before = os.getloadavg()[0]
        folder = Path(tmp) / "pipeline"
        build_tiny_sd3(folder, seed=0, sizes=sizes)
        trainer = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
        trainer.to(args.device)
        original = checksum(base_state(trainer))  # what every engine loads
        state = base_state(trainer)  # the trainer's tensors, which `perturb` changes in place
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        params = sum(t.numel() for t in state.values())
        report.note(
            f"transformer: {params / 1e6:.2f}M parameters, {len(state)} tensors, {nbytes / 1e6:.1f} MB "
            f"({', '.join(sorted({str(t.dtype).removeprefix('torch.') for t in state.values()}))}); {sizes}"
        )
        if "ray" in backends:
            import ray

            ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
            stack.callback(ray.shutdown)
        engines: dict[str, RolloutEngine] = {}
        for backend in backends:
            start = time.perf_counter()
            config = EngineConfig(
                model=str(folder), executor=backend, num_workers=1, threads_per_worker=args.threads, device=args.device
            )
            engines[backend] = stack.enter_context(RolloutEngine(config))
            print(f"  started {backend:<4} in {time.perf_counter() - start:6.2f} s", flush=True)
        timers = {} if args.no_breakdown else {backend: PushTimer(engine) for backend, engine in engines.items()}
        pushes = Pushes(trainer, args.verify, args.device)
        modes = {"copy floor": pushes.mode(make_copy_run(state)), "clone": pushes.mode(make_clone_run(state))}
        engine_modes = [
            (f"{backend} ({mib} MiB)", backend, mib, True)
            for backend in backends
            for mib in (args.mp_bucket_mib if backend == "mp" else [args.bucket_mib])
        ]
        if "uni" in engines:
            engine_modes.append((NO_CHECK_MODE, "uni", args.bucket_mib, False))
        for mode, backend, mib, check in engine_modes:
            run = functools.partial(engines[backend].update_weights, state, bucket_bytes=mib * MIB, check_finite=check)
            modes[mode] = pushes.mode(run, engines[backend], timers.get(backend), name=mode)
        if not args.no_naive:
            modes["naive"] = pushes.mode(make_naive_run(trainer, state, Path(tmp) / "naive"))
        samples = harness.run_rounds(modes, args.warmup, args.repeats)
        if checksum(state) == original:
            raise AssertionError("perturbing the trainer's copy did not change it")
        for timer in timers.values():
            timer.remove()
    report.note(
        f"{pushes.verified} checksum comparisons, all equal; load average {load_before:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end (other processes share the machine if these are high)"
    )
    summary = report_modes(report, samples, nbytes, args.device)
    breakdowns = report_breakdown(report, samples, summary, [mode for mode, *_ in engine_modes]) if timers else {}
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
