"""Allocation high-water marks on the CPU: the most bytes a piece of code held at once through
torch's CPU allocator, above what was allocated when it began (on a GPU,
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` less `memory_allocated` at the
start gives the same figure).

torch keeps no allocation statistics for the CPU, and a process's RSS moves with glibc's arenas and
page reuse. torch's profiler with `profile_memory=True` records each allocation and free of torch's
CPU allocator (bytes, time) on the thread that runs it; summed in time order they give the
high-water mark, exactly and the same on every run. Two limits follow from the profiler:

- only the profiling thread's allocations count. An engine's worker computes on a thread of its
  own, so `AllocationPeakExtension` profiles there;
- a block allocated before the start and freed during it is not reported (the profiler does not
  know its size), so such frees never lower the figure.

The profiler logs each start and stop (`USDT: ... profiler_start`), and where a process profiles
first on a thread other than its main one, once, "ERROR: External init callback must run in same
thread as registerClient": libkineto's notice that it starts on another thread than the one it
registered on. The allocation events still arrive in full (a known 15 MB peak measures 15 MB on
such a thread as on the main one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


class AllocationPeak:
    """Use as a context manager (or `start` / `stop` on one thread); `peak_bytes` afterwards."""

    def __init__(self):
        self._profile: profile | None = None
        self.peak_bytes: int | None = None

    def start(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.start()

    def stop(self) -> int:
        """Stops profiling; returns (and keeps) the peak bytes above the start."""
        self._profile.stop()
        events = self._profile.profiler.kineto_results.events()
        cpu = torch._C._autograd.DeviceType.CPU
        memory = [e for e in events if e.name() == "[memory]" and e.device_type() == cpu]
        held = peak = 0
        for event in sorted(memory, key=lambda e: e.start_ns()):  # frees are negative
            held += event.nbytes()
            peak = max(peak, held)
        self._profile, self.peak_bytes = None, peak
        return peak

    def __enter__(self) -> AllocationPeak:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class AllocationPeakExtension:
    """A worker extension (`EngineConfig(worker_extension_cls=...)`) that measures each worker's
    allocation high-water mark: `collective_rpc("start_allocation_peak")`, then the engine's work,
    then `collective_rpc("stop_allocation_peak")` gives each rank's peak bytes. A worker runs its
    steps and its RPCs on one thread (the "uni" executor's worker thread, a worker process's main
    thread, a Ray actor's), the thread the profiler watches."""

    def start_allocation_peak(self) -> None:
        self._allocation_peak = AllocationPeak()
        self._allocation_peak.start()

    def stop_allocation_peak(self) -> int:
        return self._allocation_peak.stop()


def engine_peak(engine, run: Callable[[], Any]) -> tuple[Any, list[int]]:
    """(`run()`'s result, each rank's peak bytes allocated while it ran) for an engine whose workers
    have `AllocationPeakExtension`."""
    engine.collective_rpc("start_allocation_peak")
    try:
        result = run()
    finally:
        peaks = engine.collective_rpc("stop_allocation_peak")
    return result, peaks
