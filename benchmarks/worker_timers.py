"""Timers on a worker's own pieces (its methods, or the functions its modules call), for breakdowns
finer than a `StepReport`: installed and removed through `collective_rpc`, so they run in the
worker's thread or process whatever the executor.

    engine.collective_rpc(install_timers, args=((("decode", "adapter.decode"),), device))
    ...                                          # the runs to break down
    seconds = engine.collective_rpc(remove_timers)[0]   # {"decode": [s, s, ...]}
"""

from __future__ import annotations

import functools
import importlib
import operator
import time
from collections.abc import Callable

from benchmarks.harness import synchronize

# Worker-piece timers. A piece is (name, target): `target` is "attr.path.method" on the worker, or
# "package.module:function" for a function a module calls by its global name. The timer is set as
# an attribute of the owner (on an instance it shadows the method) and removed again afterwards;
# every call appends its seconds to the piece's list. A method of the worker itself goes on its
# class: executors send a step as `Worker.execute` called with the worker (`call_function`), so an
# instance attribute would never be called.


def _resolve(worker, target: str) -> tuple[object, str]:
    if ":" in target:
        module, attribute = target.split(":")
        return importlib.import_module(module), attribute
    path, _, attribute = target.rpartition(".")
    return (operator.attrgetter(path)(worker) if path else type(worker)), attribute


def _timed(fn: Callable, seconds: list[float], device: str | None) -> Callable:
    @functools.wraps(fn)  # its name: a step keeps a merged LoRA adapter only when named `execute`
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
