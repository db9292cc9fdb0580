"""What bookkeeping costs as the queue grows: `add_request` and aborting every queued request.

A service with many clients, or a trainer that queues a whole step's groups and then pauses with
`abort`, keeps thousands of requests queued. Their cost should not grow with the queue. For each
queue length N the engine (tiny SD3, `uni`; no step runs, so this is bookkeeping alone) gets N
queued requests, then:

  add_request   median µs of one more `add_request` (one sample each) with N queued
  abort all     seconds of one `abort(ids)` of all N queued, and µs per request

    python -m benchmarks.request_table [--sizes 64,1024,8192]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import json_args, write_json
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.tiny import build_tiny_sd3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.request_table",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--sizes", default="64,1024,8192", help="comma-separated queue lengths N")
    parser.add_argument("--timed-adds", type=int, default=64, help="add_request calls timed at each N")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    return parser.parse_args(argv)


def measure(engine: RolloutEngine, queued: int, timed_adds: int) -> dict:
    params = SamplingParams(num_inference_steps=2, seed=0)
    ids = [engine.add_request("a red square", params)[0] for _ in range(queued - timed_adds)]
    seconds = []
    for _ in range(timed_adds):  # the queue holds N - timed_adds .. N - 1 while these run
        start = time.perf_counter()
        ids += engine.add_request("a red square", params)
        seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    aborted = engine.abort(ids)
    abort_s = time.perf_counter() - start
    if len(aborted) != queued or engine.has_unfinished_requests():
        raise RuntimeError(f"abort left requests behind: {len(aborted)} of {queued} aborted")
    return {
        "queued": queued,
        "add_request_us": 1e6 * statistics.median(seconds),
        "abort_all_s": abort_s,
        "abort_per_request_us": 1e6 * abort_s / queued,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="rollout-request-table-") as folder:
        with RolloutEngine(EngineConfig(model=str(build_tiny_sd3(folder)))) as engine:
            rows = [measure(engine, size, min(args.timed_adds, size)) for size in sizes]
    print(f"{'queued':>8} {'add_request µs':>15} {'abort all s':>12} {'abort µs/request':>17}")
    for row in rows:
        print(
            f"{row['queued']:>8} {row['add_request_us']:>15.1f} {row['abort_all_s']:>12.4f} "
            f"{row['abort_per_request_us']:>17.1f}"
        )
    result = {"args": json_args(args), "rows": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
