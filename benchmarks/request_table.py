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

import tempfile
import time

from benchmarks import harness
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.tiny import build_tiny_sd3


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
        "add_request_us": harness.Stats.of(seconds, 1e6).to_json(),
        "abort_all_s": abort_s,
        "abort_per_request_us": 1e6 * abort_s / queued,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser("request_table", __doc__)
    parser.add_argument("--sizes", default="64,1024,8192", help="comma-separated queue lengths N")
    parser.add_argument("--timed-adds", type=harness.positive_int, default=64, help="add_request calls timed per N")
    args = parser.parse_args(argv)
    report = harness.Report("request_table", args, __doc__, argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="rollout-request-table-") as folder:
        with RolloutEngine(EngineConfig(model=str(build_tiny_sd3(folder)))) as engine:
            rows = [measure(engine, size, min(args.timed_adds, size)) for size in sizes]
    report.results["rows"] = rows
    report.table(
        "bookkeeping with N queued (tiny SD3, uni, no step)",
        ["queued", "add_request µs (median)", "abort all ms", "abort µs/request"],
        [
            [row["queued"], row["add_request_us"]["median"], 1e3 * row["abort_all_s"], row["abort_per_request_us"]]
            for row in rows
        ],
    )
    return report.finish()


if __name__ == "__main__":
    main()
