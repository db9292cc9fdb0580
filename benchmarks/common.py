"""Benchmark plumbing shared by the scripts in this folder: interleaved warmup + timed rounds,
timed calls, timers on a worker's methods (installed through `collective_rpc`, so they run in the
worker's thread or process whatever the executor), the statistics the reports share, and the
`--json` output."""

from __future__ import annotations

import gc
import importlib
import json
import operator
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


def synchronize(device: str | None) -> None:
    if device is not None and device.startswith("cuda"):
        torch.cuda.synchronize(device)


# Rounds.


@dataclass(frozen=True)
class Round:
    index: int  # 0-based over warmup and timed rounds (the scripts also use it as a seed)
    timed: bool
    tag: str  # "warmup" or "round k/n", for the progress lines
    order: list  # the modes, rotated by `index`


def interleaved_rounds(modes: Iterable, warmup: int, repeats: int) -> Iterator[Round]:
    """`warmup` untimed rounds, then `repeats` timed ones; round r runs the modes rotated by r, so no
    mode always follows the same one."""
    modes = list(modes)
    for index in range(warmup + repeats):
        timed = index >= warmup
        rotation = index % len(modes)
        tag = f"round {index - warmup + 1}/{repeats}" if timed else "warmup"
        yield Round(index, timed, tag, modes[rotation:] + modes[:rotation])


def timed_call(fn: Callable, *args, device: str | None = None) -> tuple[object, float]:
    """`fn(*args)` and its wall seconds, timed after a garbage collection; on a CUDA `device` the
    device is synchronized before and after, so queued kernels count where they were launched."""
    gc.collect()
    synchronize(device)
    start = time.perf_counter()
    result = fn(*args)
    synchronize(device)
    return result, time.perf_counter() - start


# Worker-piece timers. A piece is (name, target): `target` is "attr.path.method" on the worker, or
# "package.module:function" for a function a module calls by its global name. The timer is set as
# an attribute of the owner (on an instance it shadows the method) and removed again afterwards;
# every call appends its seconds to the piece's list.


def _resolve(worker, target: str) -> tuple[object, str]:
    if ":" in target:
        module, attribute = target.split(":")
        return importlib.import_module(module), attribute
    path, _, attribute = target.rpartition(".")
    return (operator.attrgetter(path)(worker) if path else worker), attribute


def _timed(fn: Callable, seconds: list[float], device: str | None) -> Callable:
    def wrapper(*args, **kwargs):
        synchronize(device)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            synchronize(device)
            seconds.append(time.perf_counter() - start)

    return wrapper


def install_timers(worker, pieces: tuple[tuple[str, str], ...], device: str | None = None) -> None:
    """Wrap every piece's method in a timer; with a CUDA `device` each timed call synchronizes it."""
    timings: dict[str, list[float]] = {name: [] for name, _ in pieces}
    restore = []  # (owner, attribute, original, or None where the attribute was not the owner's own)
    for name, target in pieces:
        owner, attribute = _resolve(worker, target)
        original = getattr(owner, attribute)
        restore.append((owner, attribute, original if attribute in vars(owner) else None))
        setattr(owner, attribute, _timed(original, timings[name], device))
    worker.benchmark_timers = (timings, restore)


def take_timings(worker) -> dict[str, list[float]]:
    """The seconds of every timed call since the last take, per piece; the lists start empty again."""
    timings, _ = worker.benchmark_timers
    taken = {name: list(seconds) for name, seconds in timings.items()}
    for seconds in timings.values():
        seconds.clear()
    return taken


def remove_timers(worker) -> dict[str, list[float]]:
    """Put the original methods back; returns the seconds not taken yet."""
    taken = take_timings(worker)
    _, restore = worker.benchmark_timers
    for owner, attribute, original in reversed(restore):
        if original is None:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, original)
    del worker.benchmark_timers
    return taken


# Statistics.


def spread(values: list[float], unit: str = "s", scale: float = 1.0) -> dict[str, float]:
    """Median, min and max of `values` (seconds) times `scale`, keyed `median_<unit>` and so on."""
    return {
        f"median_{unit}": scale * statistics.median(values),
        f"min_{unit}": scale * min(values),
        f"max_{unit}": scale * max(values),
    }


def per_round_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the rounds' ratios (runs of one round are seconds apart, so they share the
    machine's load)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


# JSON output.


def json_args(args) -> dict:
    """The parsed command line, JSON-ready (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(path: Path | None, result: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {path}")
