"""HTTP weight push: a full-weight `update_weights` through the service, streamed in buckets, against
the one-body form it replaced and the same push in process, with the server's peak memory.

Builds an SD3 pipeline whose transformer has `--layers` blocks of `--heads` heads of 64 (random
weights; 12 x 12: 1.0 GB in float32), serves it in `--dtype` (executor uni, an API key), and pushes
the whole transformer, perturbed before each round so every push changes every weight, three ways:

  streamed    `RemoteRolloutEngine.update_weights(state)`: bucket frames of `--bucket-mb`, each staged
              by the server as it arrives (`rollout.serve.weight_stream`), written by the client from
              the tensors' memory to a socket of its own (`rollout.serve.socket_post`);
  streamed httpx  the same push sent by httpx (`weight_push="httpx"`), which copies every piece;
  one body    the form it replaced: one safetensors file of every tensor (`tensors_to_bytes`), posted
              whole, read whole and parsed by the server before the push;
  in-process  `RolloutEngine.update_weights(state)` on an engine of this process (executor uni);
  raw HTTP    the streamed push's bytes, sent by httpx (chunked) to a bare uvicorn route that only
              reads and drops them, on the server's own HTTP protocol (httptools,
              `rollout.http.protocol`): what the HTTP stack itself carries on this machine;
  raw socket  the same bytes sent as the streamed push sends them (`post_chunked`): the ceiling of
              the streamed push, and with raw HTTP the client's two ways side by side;
  raw h11     the same, on uvicorn's pure-Python h11 protocol, which the server ran before: its
              event loop was the push's bottleneck (a profile: h11's parser and buffer copies).

MB/s counts 1e6 bytes of tensors per second. Server CPU: the CPU seconds per GB of update spent by the
thread that runs the receiving process's event loop (its main thread: for in-process, this process's,
which does the whole push), and by all its threads. Client CPU: this process's CPU seconds per GB
during the push (`time.process_time`: the sender's, for the HTTP modes; the whole push for
in-process). On a machine shared with other work these vary far less than wall times do, and
"free-core MB/s", 1 GB over the larger of the client's and the server loop's CPU seconds per GB,
is what a push would reach with a core for each side (the two run in parallel, on two processes).

Peak memory: how far a push raises the peak RSS of the process holding the model (the server's
VmHWM, reset through /proc/<pid>/clear_refs before the push; this process's for in-process), over
the update's size. Every mode stages a copy of the update before swapping it in, so 1.0x plus a
bucket or two is the floor. Both processes run with glibc's mmap threshold fixed at 1 MiB
(`MALLOC_MMAP_THRESHOLD_`, `mallopt`), so freed buffers go back to the system and a push's peak is
not hidden by memory the one before left in the heap. After each round every engine's
`weights_checksum()` must be the trainer's.

    python -m benchmarks.http_weight_push                              # 1.0 GB float32
    python -m benchmarks.http_weight_push --layers 6 --heads 8         # 0.22 GB, serve_load's size
    python -m benchmarks.http_weight_push --dtype bfloat16 --layers 24 # 1.0 GB bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import multiprocessing
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from benchmarks import harness
from benchmarks.weight_sync import perturb
from rollout import EngineConfig, RemoteRolloutEngine, RolloutEngine
from rollout.http.wire import SAFETENSORS_MEDIA_TYPE, tensors_to_bytes
from rollout.pipelines.tiny import TinySD3Sizes, build_tiny_sd3
from rollout.serve.launch import ServerProcess, free_port
from rollout.serve.routes import ROUTES, body_json
from rollout.serve.socket_post import SocketTarget, post_chunked
from rollout.serve.weight_stream import weight_frames
from rollout.weights.state import base_state, checksum

TARGET_MB_PER_S = 1000.0  # the streamed push over loopback (issue 22: 24 GB in bf16 in under half a minute)
CLIENT_TIMEOUT_S = 600.0
MODES = ("streamed", "streamed httpx", "one body", "in-process", "raw socket", "raw HTTP", "raw h11")
RAW_MODES = {"raw socket": "rollout", "raw HTTP": "rollout", "raw h11": "h11"}  # mode: the sink's protocol
MMAP_THRESHOLD, M_MMAP_THRESHOLD = 1 << 20, -3  # bytes; mallopt's parameter number (malloc.h)
ONE_BODY_SLICE_BYTES = 1 << 20  # what the one-body mode hands httpx per write
SINK_START_S = 300.0  # a spawned process importing uvicorn took over 60 s on a loaded 2-core machine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = harness.parser("http_weight_push", __doc__, repeats=3, warmup=1, threads=1, dtype="float32")
    positive = harness.positive_int
    parser.add_argument("--layers", type=positive, default=12, help="transformer blocks")
    parser.add_argument("--heads", type=positive, default=12, help="attention heads (of 64 wide each)")
    parser.add_argument("--bucket-mb", type=positive, default=512, help="bucket_bytes of every push, in MiB")
    return parser.parse_args(argv)


def peak_rss_growth(pid: int, push) -> tuple[float, float, float, float]:
    """Bytes by which `push()` raises the peak RSS of process `pid` over its RSS before it, the
    CPU seconds its main thread (the event loop's) and the whole process spent meanwhile, and the
    CPU seconds of this process (the client's)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_bytes(pid, "VmRSS")
    loop_cpu, process_cpu = _cpu_seconds(f"/proc/{pid}/task/{pid}/stat"), _cpu_seconds(f"/proc/{pid}/stat")
    client_cpu = time.process_time()
    push()
    client_cpu = time.process_time() - client_cpu
    loop_cpu = _cpu_seconds(f"/proc/{pid}/task/{pid}/stat") - loop_cpu
    process_cpu = _cpu_seconds(f"/proc/{pid}/stat") - process_cpu
    return _status_bytes(pid, "VmHWM") - before, loop_cpu, process_cpu, client_cpu


def _cpu_seconds(stat_path: str) -> float:
    """User plus system CPU seconds in a /proc stat file (fields 14 and 15, after the name)."""
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def post_one_body(client: httpx.Client, state: dict[str, torch.Tensor], bucket_bytes: int) -> int:
    """The push as the client sent it before streaming: every tensor in one safetensors body."""
    options = body_json("update_weights", bucket_bytes=bucket_bytes)
    content = memoryview(tensors_to_bytes(state, {"request": json.dumps(options)}))
    # In slices: httpcore's sync write re-slices the bytes left after every send(), a copy of the
    # rest each time, which cost this process ~54 s of CPU per GB sent whole. The server still
    # reads one body of a known length, as before.
    slices = (content[start : start + ONE_BODY_SLICE_BYTES] for start in range(0, len(content), ONE_BODY_SLICE_BYTES))
    headers = {"content-type": SAFETENSORS_MEDIA_TYPE, "content-length": str(len(content))}
    route = ROUTES["update_weights"]
    response = client.post(route.path, content=slices, headers=headers)
    response.raise_for_status()
    return response.json()[route.answer]


def serve_sink(port: int, http: str) -> None:
    """A bare uvicorn app (in a child process) whose one route reads a body and drops it, on the
    rollout server's HTTP protocol (`http="rollout"`) or on one of uvicorn's by name."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def sink(request):
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
        return JSONResponse({"bytes": size})

    app = Starlette(routes=[Route("/sink", sink, methods=["POST"])])
    from rollout.http.protocol import server_protocol

    protocol = server_protocol(10.0) if http == "rollout" else http
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=protocol)


@contextlib.contextmanager
def sink_server(http: str) -> Iterator[str]:
    port = free_port()
    process = multiprocessing.get_context("spawn").Process(target=serve_sink, args=(port, http), daemon=True)
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SINK_START_S
        while True:
            try:
                httpx.post(f"{url}/sink", content=b"", timeout=5)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the sink server did not start within {SINK_START_S} s") from None
                time.sleep(0.2)
        yield url, process.pid
    finally:
        process.terminate()
        process.join(30)


def send_over_socket(url: str, state: dict[str, torch.Tensor], bucket_bytes: int) -> None:
    """Sends the streamed push's body as the client does (`post_chunked`) to a URL."""
    pieces = weight_frames(state, body_json("update_weights", bucket_bytes=bucket_bytes), bucket_bytes)
    target = SocketTarget.of(url)
    answer = post_chunked(target, "", {}, pieces, timeout_s=CLIENT_TIMEOUT_S, connect_timeout_s=10.0)
    if answer.status != 200:
        raise RuntimeError(f"the sink answered {answer.status}: {answer.content!r}")


class RawSender:
    """Sends the streamed push's body as the client's httpx path does (AsyncClient, chunked) to a URL."""

    def __init__(self, url: str):
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.client = httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S)

    def send(self, state: dict[str, torch.Tensor], bucket_bytes: int) -> None:
        pieces = weight_frames(state, body_json("update_weights", bucket_bytes=bucket_bytes), bucket_bytes)

        async def body():
            for piece in pieces:
                yield piece

        response = self.loop.run_until_complete(self.client.post(self.url, content=body()))
        response.raise_for_status()

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from diffusers import SD3Transformer2DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # as the server's environment sets it
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    report = harness.Report("http_weight_push", args, __doc__, argv)
    api_key, bucket_bytes = secrets.token_hex(16), args.bucket_mb << 20
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-push-") as tmp:
            sizes = TinySD3Sizes(num_layers=args.layers, num_attention_heads=args.heads, attention_head_dim=64)
            folder = build_tiny_sd3(Path(tmp) / "model", seed=0, sizes=sizes)
            dtype = getattr(torch, args.dtype)
            trainer = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
            trainer.to(dtype)
            state = base_state(trainer)  # views of the trainer's parameters: `perturb` changes them in place
            nbytes = sum(t.nbytes for t in state.values())
            threads = {"OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
            flags = ("--executor", "uni", "--dtype", args.dtype, "--max-upload-mb", str(4 * nbytes >> 20))
            config = EngineConfig(model=str(folder), executor="uni", dtype=args.dtype)
            with (
                ServerProcess.start(str(folder), *flags, api_key=api_key, env=threads) as server,
                RemoteRolloutEngine(server.url, api_key, timeout_s=CLIENT_TIMEOUT_S) as remote,
                RemoteRolloutEngine(
                    server.url, api_key, timeout_s=CLIENT_TIMEOUT_S, weight_push="httpx"
                ) as remote_httpx,
                httpx.Client(
                    base_url=server.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=CLIENT_TIMEOUT_S
                ) as plain,
                RolloutEngine(config) as local,
                contextlib.ExitStack() as sinks,
            ):
                pids = {mode: server.process.pid for mode in ("streamed", "streamed httpx", "one body")}
                pids["in-process"] = os.getpid()
                raw, sink_urls = {}, {}
                for mode, http in RAW_MODES.items():
                    url, pids[mode] = sinks.enter_context(sink_server(http))  # the row's memory means nothing
                    raw[mode] = sinks.enter_context(contextlib.closing(RawSender(f"{url}/sink")))
                    sink_urls[mode] = f"{url}/sink"
                pushes = {
                    "streamed": lambda: remote.update_weights(state, bucket_bytes=bucket_bytes),
                    "streamed httpx": lambda: remote_httpx.update_weights(state, bucket_bytes=bucket_bytes),
                    "one body": lambda: post_one_body(plain, state, bucket_bytes),
                    "in-process": lambda: local.update_weights(state, bucket_bytes=bucket_bytes),
                    "raw socket": lambda: send_over_socket(sink_urls["raw socket"], state, bucket_bytes),
                    "raw HTTP": lambda: raw["raw HTTP"].send(state, bucket_bytes),
                    "raw h11": lambda: raw["raw h11"].send(state, bucket_bytes),
                }
                seconds, growth, cpu = measure(
                    pushes, pids, {"http": remote, "in-process": local}, trainer, state, args
                )
    finally:
        torch.set_num_threads(previous_threads)
    summarize(report, seconds, growth, cpu, nbytes, len(state), bucket_bytes, args)
    return report.finish()


def measure(pushes: dict, pids: dict, engines: dict, trainer, state: dict, args) -> tuple[dict, dict, dict]:
    """Each round: perturb the trainer, run every mode once (rotated), check every engine's checksum.
    Returns each mode's seconds, peak RSS growths and (loop, process, client) CPU seconds per push."""
    seconds = {mode: [] for mode in MODES}
    growth = {mode: [] for mode in MODES}
    cpu = {mode: [] for mode in MODES}
    for round_ in harness.interleaved_rounds(MODES, args.warmup, args.repeats):
        perturb(trainer)
        expected = checksum(state)
        shown = []
        for mode in round_.order:
            (grown, *cpus), elapsed = harness.timed_call(peak_rss_growth, pids[mode], pushes[mode])
            if round_.timed:
                seconds[mode].append(elapsed)
                growth[mode].append(grown)
                cpu[mode].append(tuple(cpus))
            loop_cpu, _, client_cpu = cpus
            shown.append(
                f"{mode} {elapsed:6.2f} s (+{grown / 1e6:.0f} MB peak, loop CPU {loop_cpu:.2f} s, "
                f"client CPU {client_cpu:.2f} s)"
            )
        for name, engine in engines.items():
            if engine.weights_checksum() != expected:
                raise AssertionError(f"{name}: the engine's checksum is not the pushed state's")
        print(f"  [{round_.tag}] {'  '.join(shown)}  checksums equal", flush=True)
    return seconds, growth, cpu


def summarize(
    report, seconds: dict, growth: dict, cpu: dict, nbytes: int, tensors: int, bucket_bytes: int, args
) -> None:
    stats = {mode: harness.Stats.of(values) for mode, values in seconds.items()}
    rows, results = [], {}
    for mode in MODES:
        s, peak = stats[mode], max(growth[mode])
        mb_per_s = nbytes / 1e6 / s.median
        memory = [peak / 1e6, peak / nbytes] if mode not in RAW_MODES else ["-", "-"]
        loop_cpu, process_cpu, client_cpu = (
            statistics.median(c[i] for c in cpu[mode]) / (nbytes / 1e9) for i in (0, 1, 2)
        )
        free_core = 1e3 / max(loop_cpu, client_cpu) if mode != "in-process" else 1e3 / client_cpu
        rows.append(
            [mode, 1e3 * s.median, 1e3 * s.min, 1e3 * s.max, mb_per_s, client_cpu, loop_cpu, process_cpu, free_core]
            + memory
        )
        results[mode] = {
            "seconds": s.to_json(),
            "mb_per_s": mb_per_s,
            "free_core_mb_per_s": free_core,
            "peak_rss_growth_bytes": growth[mode],
            "cpu_seconds": {key: [c[i] for c in cpu[mode]] for i, key in enumerate(("loop", "process", "client"))},
        }
    over = {mode: stats[mode].median / stats["in-process"].median for mode in ("streamed", "one body")}
    client_cpu = {mode: statistics.median(c[2] for c in cpu[mode]) for mode in ("streamed", "streamed httpx")}
    report.table(
        f"full-weight push: {nbytes / 1e6:.0f} MB of {args.dtype} in {tensors} tensors, buckets of "
        f"{args.bucket_mb} MiB, {args.threads} threads (median of {args.repeats})",
        [
            "mode",
            "median ms",
            "min ms",
            "max ms",
            "MB/s",
            "client CPU s/GB",
            "server loop CPU s/GB",
            "server CPU s/GB",
            "free-core MB/s",
            "peak RSS growth MB",
            "growth / update",
        ],
        rows,
        f"time over in-process: streamed {over['streamed']:.2f}x, one body {over['one body']:.2f}x; "
        f"streamed vs one body: {stats['one body'].median / stats['streamed'].median:.2f}x faster; "
        f"streamed / raw socket time: {stats['streamed'].median / stats['raw socket'].median:.2f}x; "
        f"client CPU, httpx / socket: {client_cpu['streamed httpx'] / client_cpu['streamed']:.2f}x; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
        f"raw HTTP vs raw h11: {stats['raw h11'].median / stats['raw HTTP'].median:.2f}x faster",
    )
    report.check(harness.Target("streamed push MB/s", results["streamed"]["mb_per_s"], ">=", TARGET_MB_PER_S))
    free_core = results["streamed"]["free_core_mb_per_s"]
    report.check(harness.Target("streamed push free-core MB/s", free_core, ">=", TARGET_MB_PER_S))
    report.results |= {"modes": results, "bytes": nbytes, "tensors": tensors, "bucket_bytes": bucket_bytes}
    report.results |= {f"{mode}_over_in_process": ratio for mode, ratio in over.items()}
    report.results["client_cpu_httpx_over_socket"] = client_cpu["streamed httpx"] / client_cpu["streamed"]
    report.results["load_average"] = os.getloadavg()


if __name__ == "__main__":
    main()
