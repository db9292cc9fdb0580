"""What the probe tests of the service check around a bad request: that it is refused at once,
that a good request beside it gives the bytes it gives alone, that /health answers throughout, and
(where memory is the point) that the server's peak memory stays where it was."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from rollout import RemoteRolloutEngine
from rollout.serve.launch import ServerProcess

# The docs promise /health within a second; twice that on a loaded machine (as benchmarks.serve_probes).
HEALTH_BOUND_S = 2.0


class PeakMemory:
    """The growth of a process's peak resident memory (VmHWM, reset on entry) over a `with` block."""

    def __init__(self, pid: int):
        self.pid = pid

    def __enter__(self) -> PeakMemory:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS
        self.before = self._kib("VmHWM")
        return self

    def __exit__(self, *exc_info) -> None:
        self.growth_mb = (self._kib("VmHWM") - self.before) / 1024

    def _kib(self, field: str) -> int:
        lines = Path(f"/proc/{self.pid}/status").read_text().splitlines()
        return next(int(line.split()[1]) for line in lines if line.startswith(field + ":"))


class HealthWatch:
    """Polls /health from a thread while the block runs: `worst_s`, and `failures` (not 200)."""

    def __init__(self, url: str):
        self.url, self.worst_s, self.failures, self.polls = url, 0.0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(10)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                self.failures += client.get(f"{self.url}/health").status_code != 200
                self.worst_s = max(self.worst_s, time.monotonic() - start)
                self.polls += 1
                time.sleep(0.05)


def refused_beside_a_good_request(
    server: ServerProcess,
    remote: RemoteRolloutEngine,
    generate_good: Callable[[], list],
    send_bad: Callable[[], tuple[httpx.Response, float]],
    status: int,
    names: str,
    peak_mb: float | None = None,
) -> None:
    """Send the bad request while `generate_good()` runs (its steps slowed so that the two overlap):
    the bad one is refused with `status` naming `names` within a second (or twice the good one's
    time alone, if longer), raising the server's peak memory by less than `peak_mb` (None: not checked);
    the good one gives the bytes it gave alone; /health answers throughout."""
    remote.collective_rpc("set_step_delay", args=(0.05,))
    try:
        start = time.monotonic()
        (alone,) = generate_good()
        alone_s = time.monotonic() - start
        with HealthWatch(server.url) as health, ThreadPoolExecutor(1) as pool:
            beside = pool.submit(generate_good)
            time.sleep(0.1)
            with PeakMemory(server.process.pid) as memory:
                response, refused_s = send_bad()
            (together,) = beside.result(timeout=120)
    finally:
        remote.collective_rpc("set_step_delay", args=(0.0,))
    assert response.status_code == status, response.text
    assert names in response.json()["error"]["message"], response.text
    assert refused_s < max(1.0, 2 * alone_s), (refused_s, alone_s)  # a loaded machine slows both alike
    assert peak_mb is None or memory.growth_mb < peak_mb, memory.growth_mb
    assert torch.equal(together.image, alone.image)
    assert torch.equal(together.trajectory.latents.stack(), alone.trajectory.latents.stack())
    assert health.polls > 0 and health.failures == 0 and health.worst_s < HEALTH_BOUND_S, vars(health)
    assert remote.server_info()["unfinished_requests"] == 0
