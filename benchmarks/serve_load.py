"""Serve load: what the HTTP service (`python -m rollout.serve`) costs against the same work in process.

Starts the service (`ServerProcess`, executor uni, an API key) on a tiny SD3 pipeline (random weights;
`--model`: an SD3 folder instead) and measures it against in-process engines (executor uni too):

  rollouts    `--clients` threads, each a `RemoteRolloutEngine` sending `--requests-per-client` requests
              in turn (`add_request`, then `step()` until its `--samples` outputs are back), vs. the same
              requests through an `AsyncRolloutEngine` (a task per client) and a `RolloutEngine` (add
              all, `step()` until done): samples/s, server / in-process ratios (target >= 0.9), latency
              per request; every output must come back once, under its own request, and `/server_info`
              show no unfinished request after each server round;
  LoRA push   `load_lora` of a random rank-`--rank` adapter, two alternating (each push a hot swap);
              after each round a 1-step sample with it must be bitwise equal through both engines;
  weight push `update_weights(state)` of a ~219 MB float32 transformer (`--weight-*` sizes), with MB/s
              (1e6 bytes); after each round both engines' `weights_checksum()` must be the trainer's.

Rounds are interleaved, warmup rounds discarded, medians reported. The client threads run on the
server's machine: their CPU time counts against the server. `--threads` (torch threads of the server
and of this process) is 1 by default: with more threads than idle cores, torch waits for descheduled
threads at every op, which made every mode several times slower and the ratios noise on 2 cores.

    python -m benchmarks.serve_load                           # about 4 minutes on 2 CPU cores
    python -m benchmarks.serve_load --clients 16 --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.lora_swap import LORA_TARGETS, make_adapters, quiet_peft_warnings
from benchmarks.weight_sync import perturb
from rollout import EngineConfig, NodeId, RemoteRolloutEngine, RolloutEngine, RolloutOutput, SamplingParams
from rollout.engine.async_engine import AsyncRolloutEngine
from rollout.pipelines.tiny import TinySD3Sizes, build_tiny_sd3
from rollout.serve.launch import ServerProcess
from rollout.weights.state import base_state, checksum

TARGET_THROUGHPUT_RATIO = 0.9  # server samples/s over in-process samples/s
CLIENT_TIMEOUT_S = 300.0  # the longest wait for the server's next bytes: a stuck server fails the run
ROLLOUT_MODES = {
    "server": "server ({clients} HTTP clients)",
    "async": "in-process AsyncRolloutEngine ({clients} tasks)",
    "sync": "in-process RolloutEngine (add all, step)",
}
COUNTED = ("expected", "received", "lost", "duplicated", "misrouted", "not_finished")  # outputs; the last 4 must be 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = harness.parser("serve_load", __doc__, repeats=3, warmup=1, threads=1, model=None)
    positive = harness.positive_int
    run = parser.add_argument_group("what to run")
    run.add_argument("--clients", type=positive, default=64, help="concurrent clients")
    run.add_argument("--requests-per-client", type=positive, default=1, help="requests each client sends, in turn")
    run.add_argument("--samples", type=positive, default=4, help="num_samples of each request (its group)")
    run.add_argument("--steps", type=positive, default=10, help="num_inference_steps of each request")
    run.add_argument("--max-batch-size", type=positive, default=16, help="of the server and the in-process engines")
    run.add_argument("--prompt", default="a red cube on a blue table", help="every request's prompt")
    run.add_argument("--rank", type=positive, default=32, help="LoRA rank r (lora_alpha = r)")
    run.add_argument("--push-repeats", type=positive, default=5, help="timed rounds of LoRA and of weight pushes")
    sizes = parser.add_argument_group("weight push model", "the SD3 transformer of the weight pushes")
    sizes.add_argument("--weight-layers", type=positive, default=6, help="transformer blocks")
    sizes.add_argument("--weight-heads", type=positive, default=8, help="attention heads")
    sizes.add_argument("--weight-head-dim", type=positive, default=64, help="width of one head")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Answer:
    group: str
    latency_s: float | None  # from sending the request to its last output, as its client saw it
    outputs: list[RolloutOutput]


def client_requests(args: argparse.Namespace, round_index: int, client: int) -> Iterator[tuple[str, SamplingParams]]:
    """A client's requests of a round, (id, params): the same seeds in every mode and round."""
    for k in range(args.requests_per_client):
        seed = client * args.requests_per_client + k
        params = SamplingParams(num_inference_steps=args.steps, num_samples=args.samples, seed=seed)
        yield f"r{round_index}-c{client}-{k}", params


def run_server(clients: list[RemoteRolloutEngine], args, round_index: int) -> tuple[float, list[Answer]]:
    """Each client thread sends its requests one at a time; wall seconds from the release of all threads."""
    answers: list[Answer] = []  # list.append is atomic
    barrier = threading.Barrier(len(clients) + 1)

    def client_loop(index: int, client: RemoteRolloutEngine) -> None:
        barrier.wait()
        for group, params in client_requests(args, round_index, index):
            start, outputs = time.perf_counter(), []
            client.add_request(args.prompt, params, request_id=group)
            while client.has_unfinished_requests():
                outputs += client.step()
            answers.append(Answer(group, time.perf_counter() - start, outputs))

    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(client_loop, index, client) for index, client in enumerate(clients)]
        barrier.wait()
        start = time.perf_counter()
        for future in futures:
            future.result()
        return time.perf_counter() - start, answers


def run_async(engine: AsyncRolloutEngine, loop: asyncio.AbstractEventLoop, args, round_index: int):
    """One task per client: the server's closed loop without HTTP."""

    async def client(index: int) -> list[Answer]:
        answers = []
        for group, params in client_requests(args, round_index, index):
            start = time.perf_counter()
            async with await engine.add_request(args.prompt, params, request_id=group) as stream:
                outputs = [output async for output in stream]
            answers.append(Answer(group, time.perf_counter() - start, outputs))
        return answers

    async def all_clients() -> tuple[float, list[Answer]]:
        start = time.perf_counter()
        per_client = await asyncio.gather(*(client(index) for index in range(args.clients)))
        return time.perf_counter() - start, [answer for answers in per_client for answer in answers]

    return loop.run_until_complete(all_clients())


def run_sync(engine: RolloutEngine, args, round_index: int) -> tuple[float, list[Answer]]:
    """Every request queued at once, then `step()` until done (no per-request latency)."""
    start = time.perf_counter()
    for index in range(args.clients):
        for group, params in client_requests(args, round_index, index):
            engine.add_request(args.prompt, params, request_id=group)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    elapsed = time.perf_counter() - start
    return elapsed, [Answer(output.group_id, None, [output]) for output in outputs]


def check_answers(mode: str, answers: list[Answer], args, round_index: int) -> dict[str, int]:
    """Counts of outputs expected, received, lost, duplicated, misrouted (an id nobody asked for, or
    under another request's answer) and not finished; raises unless the last four are 0."""
    expected = {
        NodeId(group, s)
        for index in range(args.clients)
        for group, _ in client_requests(args, round_index, index)
        for s in range(args.samples)
    }
    outputs = [(answer.group, output) for answer in answers for output in answer.outputs]
    received = [output.node_id for _, output in outputs]
    counts = {
        "expected": len(expected),
        "received": len(received),
        "lost": len(expected - set(received)),
        "duplicated": len(received) - len(set(received)),
        "misrouted": sum(o.node_id not in expected or o.group_id != g for g, o in outputs),
        "not_finished": sum(output.status != "finished" for _, output in outputs),
    }
    if any(counts[name] for name in COUNTED[2:]):
        raise AssertionError(f"{mode}, round {round_index}: wrong answers {counts}")
    return counts


def measure_rollouts(runs: dict[str, Callable], server: RemoteRolloutEngine, args, report: harness.Report) -> None:
    """Every mode once per round; the rollouts table, the throughput targets and the answers table."""
    samples = args.clients * args.requests_per_client * args.samples
    latencies_ms = {mode: [] for mode in runs}  # per request, as its client saw it (none in sync mode)
    engine_ms = {mode: [] for mode in runs}  # per request, its outputs' timings.total_s
    counts = {mode: [] for mode in runs}  # per timed round: check_answers' counts

    def run(mode: str, round_: harness.Round) -> dict:
        (elapsed, answers), _ = harness.timed_call(runs[mode], round_.index)
        counted = check_answers(mode, answers, args, round_.index)
        if mode == "server":
            counted["unfinished_after"] = server.server_info()["unfinished_requests"]
            if counted["unfinished_after"]:
                raise AssertionError(f"server, round {round_.index}: after it, /server_info shows {counted}")
        if round_.timed:
            latencies_ms[mode] += [1e3 * a.latency_s for a in answers if a.latency_s is not None]
            engine_ms[mode] += [1e3 * max(o.timings.total_s for o in a.outputs) for a in answers]
            counts[mode].append(counted)
        return {"s": elapsed, "samples/s": samples / elapsed}

    measured = harness.run_rounds({mode: functools.partial(run, mode) for mode in runs}, args.warmup, args.repeats)
    seconds = {mode: measured[mode]["s"] for mode in runs}
    rows, results = [], {}
    for mode, label in ROLLOUT_MODES.items():
        wall = harness.Stats.of(seconds[mode])
        latency = harness.Stats.of(latencies_ms[mode]) if latencies_ms[mode] else None
        engine = harness.Stats.of(engine_ms[mode])
        results[mode] = {
            "samples_per_s": samples / wall.median,
            "seconds": wall.to_json(),
            "latency_ms": latency and latency.to_json(),
            "engine_latency_ms": engine.to_json(),
            "rounds": counts[mode],
        }
        percentiles = [stats.percentile(q) if stats else "-" for stats in (latency, engine) for q in (50, 99)]
        rows.append(
            [label.format(clients=args.clients), samples / wall.median, wall.median, wall.min, wall.max, *percentiles]
        )
    report.table(
        f"rollouts: {args.clients} clients x {args.requests_per_client} requests x {args.samples} samples = {samples}"
        f" samples per round, {args.steps} steps, max batch {args.max_batch_size}, {args.threads} threads"
        f" (median of {args.repeats} rounds)",
        ["mode", "samples/s", "median s", "min s", "max s", "p50 ms", "p99 ms", "engine p50 ms", "engine p99 ms"],
        rows,
        "p50/p99: per request, as its client saw it; engine: its timings.total_s, queued + denoising",
    )
    ratios = []
    for baseline in ("sync", "async"):
        ratio = results["server"]["samples_per_s"] / results[baseline]["samples_per_s"]
        per_round = harness.per_round_ratio(seconds[baseline], seconds["server"])  # seconds: the inverse ratio
        results[f"server_over_{baseline}"], results[f"server_over_{baseline}_per_round"] = ratio, per_round
        ratios.append([f"server / in-process {baseline}", ratio, per_round])
        report.check(harness.Target(f"server / in-process {baseline} samples/s", ratio, ">=", TARGET_THROUGHPUT_RATIO))
    report.table("throughput ratios", ["samples/s", "ratio of medians", "median of per-round ratios"], ratios)
    report.table(
        f"answers over {args.repeats} rounds (outputs)",
        ["mode", *(name.replace("_", " ") for name in COUNTED)],
        [[mode, *(sum(r[name] for r in counts[mode]) for name in COUNTED)] for mode in ROLLOUT_MODES],
        f"server: unfinished_requests after each round {[r['unfinished_after'] for r in counts['server']]}",
    )
    report.results["rollouts"] = results


def measure_pushes(report, title: str, runs: dict[str, Callable], check, nbytes: int, args, before=None) -> dict:
    """Each mode's `run(round_index)` (the push alone) once per round, `before()` ahead of a round and
    `check()` after it (untimed: each engine has taken one push, which must have landed); its table and results."""
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for round_ in harness.interleaved_rounds(runs, args.warmup, args.push_repeats):
        if before:
            before()
        pushed = []
        for mode in round_.order:
            _, elapsed = harness.timed_call(runs[mode], round_.index)
            if round_.timed:
                times[mode].append(elapsed)
            pushed.append(f"{mode} {1e3 * elapsed:7.1f} ms")
        print(f"  [{round_.tag}] {'  '.join(pushed)}  {check()}", flush=True)
    stats = {mode: harness.Stats.of(seconds, 1e3) for mode, seconds in times.items()}
    ratio = stats["http"].median / stats["in-process"].median
    per_round = harness.per_round_ratio(times["http"], times["in-process"])
    report.table(
        f"{title} (median of {args.push_repeats})",
        ["mode", "median ms", "min ms", "max ms", "MB/s"],
        [[mode, s.median, s.min, s.max, nbytes / 1e3 / s.median] for mode, s in stats.items()],
        f"http / in-process time: {ratio:.2f}x (median of per-round ratios {per_round:.2f}x)",
    )
    return {
        **{mode: {"ms": s.to_json(), "mb_per_s": nbytes / 1e3 / s.median} for mode, s in stats.items()},
        "http_over_in_process": ratio,
        "http_over_in_process_per_round": per_round,
        "bytes": nbytes,
    }


def start_server(model: Path, api_key: str, args, *flags: str) -> ServerProcess:
    # Executor uni has no flag for its torch threads; the child's torch reads OMP_NUM_THREADS.
    threads = {"OMP_NUM_THREADS": str(args.threads)}
    return ServerProcess.start(str(model), "--executor", "uni", *flags, api_key=api_key, env=threads)


def measure_on_tiny(model: Path, api_key: str, args, report: harness.Report) -> None:
    """Parts 1 and 2: they share the server and the in-process sync engine."""
    config = EngineConfig(model=str(model), executor="uni", max_batch_size=args.max_batch_size)
    with (
        start_server(model, api_key, args, "--max-batch-size", str(args.max_batch_size)) as server,
        RolloutEngine(config) as sync_engine,
    ):
        async_engine, loop = AsyncRolloutEngine(RolloutEngine(config)), asyncio.new_event_loop()
        clients = [RemoteRolloutEngine(server.url, api_key, timeout_s=CLIENT_TIMEOUT_S) for _ in range(args.clients)]
        try:
            runs = {
                "server": lambda index: run_server(clients, args, index),
                "async": lambda index: run_async(async_engine, loop, args, index),
                "sync": lambda index: run_sync(sync_engine, args, index),
            }
            measure_rollouts(runs, clients[0], args, report)
            measure_lora(model, {"http": clients[0], "in-process": sync_engine}, args, report)
        finally:
            for client in clients:
                client.shutdown()
            async_engine.shutdown()
            loop.close()


def measure_lora(model: Path, engines: dict, args, report: harness.Report) -> None:
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    transformer = SD3Transformer2DModel.from_pretrained(model, subfolder="transformer", local_files_only=True)
    config = {"r": args.rank, "lora_alpha": args.rank, "target_modules": LORA_TARGETS}
    adapters = make_adapters(transformer, LoraConfig(**config, init_lora_weights=False))
    for engine in engines.values():
        engine.load_lora("policy", adapters[1], config)  # resident: every timed push is a hot swap
    modules = engines["http"].lora_modules("policy")
    nbytes = sum(t.numel() * t.element_size() for t in adapters[0].values())
    runs = {
        mode: lambda index, engine=engine: engine.load_lora("policy", adapters[index % 2], config)
        for mode, engine in engines.items()
    }

    def check() -> str:  # a 1-step sample with the adapter: bitwise the same through every engine
        params = SamplingParams(num_inference_steps=1, seed=7, lora="policy", return_trajectory=False)
        first, *others = (engine.generate([args.prompt], params)[0].image for engine in engines.values())
        if not all(torch.equal(first, image) for image in others):
            raise AssertionError("the adapter pushed over HTTP does not sample as the one pushed in process")
        return "adapter samples bitwise equal"

    title = f"LoRA push: rank {args.rank}, {modules} modules, {nbytes / 1e6:.2f} MB"
    results = measure_pushes(report, title, runs, check, nbytes, args)
    report.results["lora_push"] = results | {"rank": args.rank, "modules": modules}


def measure_weight_push(folder: Path, api_key: str, args, report: harness.Report) -> None:
    from diffusers import SD3Transformer2DModel

    sizes = TinySD3Sizes(
        num_layers=args.weight_layers, num_attention_heads=args.weight_heads, attention_head_dim=args.weight_head_dim
    )
    build_tiny_sd3(folder, seed=0, sizes=sizes)
    trainer = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
    state = base_state(trainer)  # views of the trainer's parameters: `perturb` changes them in place
    parameters, nbytes = sum(t.numel() for t in state.values()), sum(t.nbytes for t in state.values())
    title = f"weight push: {parameters / 1e6:.1f}M parameters, {nbytes / 1e6:.1f} MB"
    with (
        start_server(folder, api_key, args) as server,
        RemoteRolloutEngine(server.url, api_key, timeout_s=CLIENT_TIMEOUT_S) as remote,
        RolloutEngine(EngineConfig(model=str(folder), executor="uni")) as local,
    ):
        engines = {"http": remote, "in-process": local}
        expected = []

        def before() -> None:
            perturb(trainer)
            expected.append(checksum(state))

        def check() -> str:
            for mode, engine in engines.items():
                got = engine.weights_checksum()
                if got != expected[-1]:
                    raise AssertionError(f"{mode}: engine checksum {got[:12]} != pushed state's {expected[-1][:12]}")
            return f"checksums equal {expected[-1][:12]}"

        runs = {mode: lambda index, engine=engine: engine.update_weights(state) for mode, engine in engines.items()}
        results = measure_pushes(report, title, runs, check, nbytes, args, before)
    report.results["weight_push"] = results | {"parameters": parameters, "tensors": len(state)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # httpx and the engines: quiet
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    quiet_peft_warnings()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the in-process engines run in this process (and the header says so)
    report = harness.Report("serve_load", args, __doc__, argv)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    api_key = secrets.token_hex(16)
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-serve-") as tmp:
            model = args.model or build_tiny_sd3(Path(tmp) / "tiny", seed=0)
            measure_on_tiny(model, api_key, args, report)
            measure_weight_push(Path(tmp) / "weights", api_key, args, report)
    finally:
        torch.set_num_threads(previous_threads)
    total, load_after = time.perf_counter() - start, os.getloadavg()[0]
    report.note(f"total {total:.1f} s; load average {load_before:.2f} at the start, {load_after:.2f} at the end")
    report.results |= {"total_s": total, "load_average": [load_before, load_after]}
    return report.finish()


if __name__ == "__main__":
    main()
