"""Serve probes: a shared rollout server against careless and hostile clients (issues 19 and 37).

Starts `python -m rollout.serve` (executor mp, 2 workers, an API key) on a tiny SD3 pipeline built in a
temporary folder and sends each probe while a well-formed streamed request runs: wrong types, NaN and absurd
magnitudes, bodies that cost more than they weigh (a PNG bomb to a model that takes no images, 10 MB of JSON
in a safetensors generate's metadata), a schedule whose log-prob is NaN, a request_id of the engine's own, a
push taking the weight version back (or past 64 bits), LoRA uploads that could break PEFT or hang it or bind
nothing, paths that are FIFOs or devices or files whose tensor names are not the client's to read, worker
functions that would bypass the engine or wait for 1e308 s, a foreign Host, a text/plain body, a 65 KiB
head, half-sent connections; then a one-step generate while a weight push trickles in (a byte every 0.5 s),
and ten pushes that each announce a 500 MB bucket and send 1 KiB of it. One row per
probe (what was sent, the status, seconds, the start of the message); checked, for the whole run:

  - every probe got the status it should, within a second (--probe-bound-s);
  - the good request finished with the same bytes (image and trajectory) as when run alone;
  - /health, polled every 0.1 s from a thread, always answered within a second (--health-bound-s);
  - no message named the tensors of the server's file, and the trickling push held no generation (the
    one-step generate beside it took under --probe-bound-s plus a few steps of the good request);
  - the announced pushes raised the server's RSS by what they sent (and pages faulted in a few MiB ahead),
    not by what they announced (--announced-slack-mb), and nothing once closed;
  - afterwards the server's RSS (server and workers) is within --rss-slack-mb of where it was,
    and /dev/shm holds the server's blocks it held before (and the reused ones: call arguments, replies).

    python -m benchmarks.serve_probes            # about 1.5 minutes on 2 CPU cores
    python -m benchmarks.serve_probes --json out.json
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import socket
import struct
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks import harness
from benchmarks.bad_pushes import TricklingPush, chunk, open_push
from rollout import RemoteRolloutEngine, SamplingParams
from rollout.http.wire import LENGTH, SAFETENSORS_MEDIA_TYPE, tensors_to_bytes
from rollout.pipelines.tiny import build_tiny_sd3
from rollout.serve.launch import ServerProcess

# Long enough to run through every probe and push (checked: it must still be running after the
# last one); 800 steps (11 s alone on 2 CPU cores) ended before the last push. The server takes
# up to 2000 steps (--max-inference-steps) for it.
GOOD = SamplingParams(num_inference_steps=2000, num_samples=2, seed=7)
# The one-step generate beside the trickling push: of a size the good request's batch does not take.
# In a batch with one of the good samples it changed that sample's numbers (the transformer's
# forward of a row is not bitwise the same in a batch of one and of two: 6e-7 on CPU), which
# looked like the pushes' doing.
BESIDE = SamplingParams(num_inference_steps=1, seed=0, height=16, width=16)
JSON = {"content-type": "application/json"}
FOREIGN_NAME = "someone_elses_model.private_layer"  # must appear in no answer
SAFETENSORS = {"content-type": SAFETENSORS_MEDIA_TYPE}


@dataclass
class Probe:
    name: str  # what was sent, in a few words
    send: object  # fn(client) -> httpx.Response
    status: int  # what it must get


def make_adapter(model: Path) -> tuple[dict, dict]:
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from rollout.pipelines.loading import load_adapter

    transformer = load_adapter(str(model)).transformer
    torch.manual_seed(0)
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["to_q", "to_v"]}
    transformer.add_adapter(LoraConfig(**config, init_lora_weights=False), adapter_name="made")
    state = get_peft_model_state_dict(transformer, adapter_name="made")
    return {key: value.detach().clone() for key, value in state.items()}, config


def make_files(folder: Path, tensors: dict, config: dict) -> dict[str, Path]:
    """Paths that are not what they are named: a FIFO of weights, a device, a directory named like a
    weights file, a LoRA folder whose weights are a FIFO, a 1 GB sparse adapter_config.json."""
    from safetensors.torch import save_file

    paths = {name: folder / name for name in ("fifo", "device.safetensors", "dir", "fifo_lora", "sparse_lora")}
    paths["foreign.safetensors"] = folder / "foreign.safetensors"  # tensors of someone else's
    save_file({f"{FOREIGN_NAME}.{k}": torch.zeros(2) for k in range(3)}, paths["foreign.safetensors"])
    paths["fifo"].mkdir()
    os.mkfifo(paths["fifo"] / "diffusion_pytorch_model.safetensors")
    paths["device.safetensors"].symlink_to("/dev/urandom")
    (paths["dir"] / "x.safetensors").mkdir(parents=True)
    paths["fifo_lora"].mkdir()
    (paths["fifo_lora"] / "adapter_config.json").write_text(json.dumps(config))
    os.mkfifo(paths["fifo_lora"] / "adapter_model.safetensors")
    paths["sparse_lora"].mkdir()
    save_file(tensors, paths["sparse_lora"] / "adapter_model.safetensors")
    with open(paths["sparse_lora"] / "adapter_config.json", "wb") as sparse:
        sparse.truncate(1 << 30)
    return paths


def probes(tensors: dict, config: dict, files: dict[str, Path]) -> list[Probe]:
    def generate(body: str):
        return lambda client: client.post("/rollout/generate", content=body.encode(), headers=JSON)

    def params(**fields: str):
        """A generate request whose params are raw JSON text (NaN and 1e30 are not Python's JSON)."""
        return generate('{"prompts": ["x"], "params": {' + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}}")

    def lora(changes: dict, name: str = "policy", tensors: dict = tensors, version: int | None = None):
        request = json.dumps({"lora_name": name, "lora_config": {**config, **changes}, "version": version})
        body = tensors_to_bytes(tensors, {"request": request})
        return lambda client: client.post("/v1/load_lora_adapter", content=body, headers=SAFETENSORS)

    def post(path: str, body: dict):
        return lambda client: client.post(path, json=body)

    def from_disk(file: str):
        return post("/update_weights_from_disk", {"model_path": str(files[file])})

    def lora_folder(file: str):
        return post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(files[file])})

    def rpc(method: str, *args):
        return post("/collective_rpc", {"method": method, "args": list(args)})

    def resume(**request):
        return lambda client: client.post("/resume", **request)

    def with_png(png: bytes):
        """A generate request with one input image, a PNG file's bytes (SD3 takes none)."""
        request = json.dumps({"prompts": "x", "params": {"num_inference_steps": 1}})
        image = torch.frombuffer(bytearray(png), dtype=torch.uint8)
        body = tensors_to_bytes({"images.0.0.png": image}, {"request": request})
        return lambda client: client.post("/rollout/generate", content=body, headers=SAFETENSORS)

    def metadata_of(size: int):
        """A generate body of safetensors (the form with input images) whose metadata JSON is `size` bytes."""
        request = json.dumps({"prompts": ["x"] * (size // 5), "params": {"num_inference_steps": 1}})
        body = tensors_to_bytes({}, {"request": request})
        return lambda client: client.post("/rollout/generate", content=body, headers=SAFETENSORS)

    key = sorted(tensors)[0]
    bogus = {**tensors, key.replace(".lora_A.", ".lora_C."): tensors[key].clone()}
    rendezvous = rpc("init_weight_update_group", "0.0.0.0", 29500, 0, 1, "gloo", 1.0)
    bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "bucket_bytes": -1}
    return [
        Probe("height 68 (the tiny transformer takes 64)", params(height="68"), 400),
        Probe("height 1e30", params(height="1e30"), 422),
        Probe("num_inference_steps 1e30", params(num_inference_steps="1e30"), 422),
        Probe(
            "num_inference_steps 10^8 with branch_steps [0]",
            params(num_inference_steps="100000000", branch_steps="[0]"),
            400,
        ),
        Probe("num_inference_steps 10^7", params(num_inference_steps="10000000"), 400),
        Probe("branch_factor 10^30", params(branch_steps="[0]", branch_factor="1" + "0" * 30), 400),
        Probe("a 0.9 MB prompt", generate(json.dumps({"prompts": ["x" * 900_000]})), 400),
        Probe("noise_level NaN", params(noise_level="NaN"), 422),
        Probe("noise_level Infinity", params(noise_level="Infinity"), 422),
        Probe("guidance_scale 1e308", params(guidance_scale="1e308"), 400),
        Probe("guidance_scale NaN", params(guidance_scale="NaN"), 422),
        Probe('num_samples "2"', params(num_samples='"2"'), 422),
        Probe("num_inference_steps true", params(num_inference_steps="true"), 422),
        Probe("sigmas [1e-30] (a NaN log-prob)", params(num_inference_steps="1", sigmas="[1e-30]"), 400),
        Probe(
            'request_id "req99", of the ids the engine makes',
            generate(json.dumps({"prompts": "x", "params": {"num_inference_steps": 1}, "request_id": "req99"})),
            400,
        ),
        Probe("a 17 KB PNG of 12000 x 12000 pixels (2 GB decoded)", with_png(png_of_zeros(12000, 12000)), 400),
        Probe("a generate as safetensors with 10 MB of JSON in its metadata", metadata_of(10 << 20), 413),
        Probe('same_noise_in_group "yes"', params(same_noise_in_group='"yes"'), 422),
        Probe("LoRA target_modules as a backtracking regex", lora({"target_modules": "(?:[^.]|[^.]|[^.])*Q"}), 400),
        Probe("LoRA r -1", lora({"r": -1}), 400),
        Probe("LoRA layer_replication", lora({"layer_replication": [[0, 1]]}), 400),
        Probe("LoRA with an empty name", lora({}, name=""), 400),
        Probe("LoRA rank 3 with rank-2 tensors (refused naming a tensor)", lora({"r": 3}), 400),
        Probe("LoRA hot swap with one bogus key", lora({}, tensors=bogus), 400),
        Probe("LoRA hot swap taking the weight version to -5", lora({}, version=-5), 400),
        Probe("LoRA hot swap to a weight version of 4300 digits", lora({}, version=10**4299), 422),
        Probe("LoRA with no tensors (it would bind no module)", lora({}, tensors={}), 400),
        Probe("weights from a folder with a FIFO", from_disk("fifo"), 400),
        Probe("weights from a symlink to /dev/urandom", from_disk("device.safetensors"), 400),
        Probe("weights from a directory named x.safetensors", from_disk("dir"), 400),
        # mode "pause": refused between two steps; "wait" would first run the good request to its end.
        Probe(
            "weights from a file that is not this model's",
            post("/update_weights_from_disk", {"model_path": str(files["foreign.safetensors"]), "mode": "pause"}),
            400,
        ),
        Probe("LoRA folder whose weights are a FIFO", lora_folder("fifo_lora"), 400),
        Probe("LoRA folder with a 1 GB sparse config", lora_folder("sparse_lora"), 400),
        Probe("collective_rpc sleep", rpc("sleep", 1), 403),
        Probe("collective_rpc unload_lora", rpc("unload_lora", "policy"), 403),
        Probe("collective_rpc init_weight_update_group on 0.0.0.0", rendezvous, 403),
        Probe("bucket_bytes -1", post("/update_weights_from_distributed", bucket), 422),
        Probe("collective_rpc timeout 1e308", post("/collective_rpc", {"method": "get_rank", "timeout": 1e308}), 400),
        Probe("a 65 KiB head", lambda client: client.get("/health", headers={"x-filler": "x" * (65 << 10)}), 400),
        Probe("no key", lambda client: httpx.post(f"{client.base_url}/resume", json={}), 401),
        Probe("a foreign Host (DNS rebinding)", resume(json={}, headers={"host": "attacker.example"}), 400),
        Probe("a text/plain body", resume(content=b"{}", headers={"content-type": "text/plain"}), 415),
        Probe("GET /openapi.json without the key", lambda client: httpx.get(f"{client.base_url}/openapi.json"), 401),
        Probe("an unknown route", lambda client: client.get("/no/such/route"), 404),
        Probe("a wrong method", lambda client: client.get("/rollout/generate"), 405),
    ]


def png_of_zeros(height: int, width: int, colour: bool = False, rows: int | None = None) -> bytes:
    """A PNG file of a black image, written without holding its pixels (PIL would): 1-bit grey, or
    8-bit RGB with `colour`. Zeros deflate about 1000 to 1: 12000 x 12000 at 1 bit is 17 KB.
    `rows`: how many rows its (whole) zlib stream holds, if not all."""
    bits, color_type, channels = (8, 2, 3) if colour else (1, 0, 1)
    row = bytes(1 + (width * bits * channels + 7) // 8)  # a filter byte, then the row's samples
    compressor = zlib.compressobj(9)
    data = b"".join(compressor.compress(row) for _ in range(height if rows is None else rows)) + compressor.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, bits, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def half_sent_connections(url: str, count: int, header_timeout_s: float) -> float:
    """Open `count` connections that send half a request; seconds until the server closed them all."""
    port = int(url.rpartition(":")[2])
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=header_timeout_s + 20) for _ in range(count)]
    start = time.monotonic()
    for sock in sockets:
        sock.sendall(b"POST /rollout/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    for sock in sockets:
        assert sock.recv(1) == b"", "a half-sent connection got an answer"
        sock.close()
    return time.monotonic() - start


def announced_pushes(url: str, key: str, pids: list[int], count: int, announced_mb: int) -> tuple[float, float]:
    """`count` pushes in turn, each announcing a bucket of `announced_mb` and sending 1 KiB of it
    before it drops: the RSS growth while the last was held, and a second after all were gone."""
    before, held = rss_mb(pids), 0.0
    for _ in range(count):
        sock = open_push(url, key)
        sock.sendall(chunk(LENGTH.pack(announced_mb << 20) + bytes(1024)))
        time.sleep(0.5)
        held = max(held, rss_mb(pids) - before)
        sock.close()
    time.sleep(1.0)
    return held, rss_mb(pids) - before


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as status:
            total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return total / 1024


class HealthWatch(threading.Thread):
    """Polls /health every 0.1 s; `worst_s` is the slowest answer, `failures` the non-200 ones and
    the polls that got no answer (a connection closed under it counts: it must not end the watch)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.worst_s, self.failures, self.polls = url, 0.0, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.TransportError:
                    ok = False
                self.worst_s = max(self.worst_s, time.monotonic() - start)
                self.failures += not ok
                self.polls += 1
                time.sleep(0.1)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser("serve_probes", __doc__)
    parser.add_argument("--probe-bound-s", type=float, default=1.0, help="most seconds a probe's answer may take")
    parser.add_argument("--health-bound-s", type=float, default=1.0, help="most seconds /health may take")
    parser.add_argument(
        "--announced-slack-mb", type=float, default=100.0, help="RSS growth allowed while 500 MB are announced"
    )
    parser.add_argument("--rss-slack-mb", type=float, default=200.0, help="RSS growth allowed over the run")
    args = parser.parse_args(argv)
    report = harness.Report("serve_probes", args, __doc__, argv)
    key = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="rollout-probes-") as tmp:
        model = build_tiny_sd3(Path(tmp) / "pipeline", seed=0)
        tensors, config = make_adapter(Path(model))
        files = make_files(Path(tmp), tensors, config)
        flags = ("--executor", "mp", "--num-workers", "2", "--header-timeout-s", "2", "--max-inference-steps", "2000")
        with (
            ServerProcess.start(str(model), *flags, api_key=key) as server,
            RemoteRolloutEngine(server.url, key) as remote,
        ):
            remote.load_lora("policy", tensors, config)  # the adapter the bad hot swaps must leave serving
            alone = remote.generate("a red square", GOOD)
            pids = [server.process.pid, *_worker_pids(server.process.pid)]
            rss_before = rss_mb(pids)
            shm_before = set(glob.glob(f"/dev/shm/rollout-{server.process.pid}-*"))
            watch = HealthWatch(server.url)
            watch.start()
            (good_id, *_) = remote.add_request("a red square", GOOD, request_id="good")
            with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
                rows = [send(probe, client, args.probe_bound_s) for probe in probes(tensors, config, files)]
            half_s = half_sent_connections(server.url, 50, 2.0)
            trickling = TricklingPush(server.url, key)
            trickling.start()
            time.sleep(1.0)  # being received
            with RemoteRolloutEngine(server.url, key) as beside:  # `remote` streams the good request
                start = time.monotonic()
                beside.generate("beside a trickling push", BESIDE)
                beside_trickle_s = time.monotonic() - start
            trickling.close()
            announced_held, announced_after = announced_pushes(server.url, key, pids, 10, 500)
            running = remote.server_info()["running_requests"]
            together = []
            while remote.has_unfinished_requests():
                together += remote.step()
            watch.stop.set()
            watch.join()
            remote.unload_lora("policy")
            time.sleep(1.0)
            rss_after = rss_mb(pids)
            # Only the blocks the mp executor rewrites for every call's arguments ("-args-") and each
            # worker for its replies ("-replies-", 4 MiB at most, made at a worker's first small reply
            # with tensors: the good request's trajectories are larger) may stay.
            shm = {
                path
                for path in glob.glob(f"/dev/shm/rollout-{server.process.pid}-*")
                if "-args-" not in path and "-replies-" not in path
            }
            shm -= shm_before
    different = sum(
        not (torch.equal(a.image, b.image) and torch.equal(a.trajectory.latents.stack(), b.trajectory.latents.stack()))
        for a, b in zip(alone, sorted(together, key=lambda output: output.sample_index), strict=True)
    )
    report.table(
        f"probes (sent while the good request streams; each must get its status within {args.probe_bound_s} s)",
        ["probe", "want", "got", "s", "verdict", "message"],
        [[row[key] for key in ("probe", "expected", "status", "seconds", "verdict", "message")] for row in rows],
    )
    report.note(f"50 half-sent connections: all closed after {half_s:.2f} s (--header-timeout-s 2)")
    report.note(
        f"the good request ({good_id}, {len(together)} samples, streamed through every probe): "
        f"{'the same bytes as alone' if not different else f'{different} samples DIFFERENT from alone'}; "
        f"still running after the last probe: {running > 0}"
    )
    report.note(f"/health: {watch.polls} polls, slowest {watch.worst_s:.3f} s, {watch.failures} not 200")
    report.note(f"a one-step generate while a push trickled in: {beside_trickle_s:.2f} s")
    report.note(
        f"10 pushes announcing 500 MB and sending 1 KiB each: RSS +{announced_held:.0f} MB while held, "
        f"+{announced_after:.0f} MB a second after they dropped"
    )
    named = sum(FOREIGN_NAME in row["message"] for row in rows)
    report.note(
        f"RSS of the server and its workers: {rss_before:.0f} MB before, {rss_after:.0f} MB after; "
        f"/dev/shm blocks left beyond those kept for call arguments and replies: {len(shm)}"
    )
    for target in (
        harness.Target("probes with the wrong status", sum(r["status"] != r["expected"] for r in rows), "==", 0),
        harness.Target("slowest probe s", max(r["seconds"] for r in rows), "<", args.probe_bound_s),
        harness.Target("requests still running after the last probe", running, ">", 0),
        harness.Target("good request's samples not bitwise as alone", different, "==", 0),
        harness.Target("/health polls not 200 or unanswered", watch.failures, "==", 0),
        harness.Target("/health slowest s", watch.worst_s, "<", args.health_bound_s),
        harness.Target("answers naming the server file's tensors", named, "==", 0),
        harness.Target("one-step generate beside a trickling push s", beside_trickle_s, "<", args.probe_bound_s + 4),
        harness.Target("RSS growth MB while 500 MB are announced", announced_held, "<", args.announced_slack_mb),
        harness.Target("RSS growth MB", rss_after - rss_before, "<", args.rss_slack_mb),
        harness.Target("/dev/shm blocks left", len(shm), "==", 0),
    ):
        report.check(target)
    report.results = {
        "probes": rows,
        "half_sent_close_s": half_s,
        "health": {"polls": watch.polls, "worst_s": watch.worst_s, "failures": watch.failures},
        "rss_mb": [rss_before, rss_after],
        "announced_pushes_rss_mb": [announced_held, announced_after],
        "beside_trickling_push_s": beside_trickle_s,
        "shm_left": sorted(shm),
    }
    return report.finish()


def send(probe: Probe, client: httpx.Client, bound_s: float) -> dict:
    """The probe's answer: status, seconds, the start of its message and whether it came in time."""
    start = time.monotonic()
    response = probe.send(client)
    seconds = time.monotonic() - start
    try:
        message = response.json().get("error", {}).get("message", "")
    except ValueError:
        message = response.text
    fields = {"probe": probe.name, "expected": probe.status, "status": response.status_code, "seconds": seconds}
    met = response.status_code == probe.status and seconds < bound_s
    return fields | {"message": message[:110], "verdict": "" if met else "MISSED"}


def _worker_pids(server_pid: int) -> list[int]:
    """The server's child processes (its mp workers)."""
    return [int(pid) for pid in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()]


if __name__ == "__main__":
    main()
