"""Fault figures: what a trainer that leaves the engine running for days relies on, per backend.

kill        a worker process (mp, ray) SIGKILLed mid-rollout, mid-update and mid-RPC, slowed by a
            patch sent through `collective_rpc` so the kill lands mid-call: seconds until the call
            fails with EngineDeadError, and processes and /dev/shm blocks left (goal: <= 5 s, none);
lora        300 load / hot-swap / unload cycles alternating two layouts (rank 64 and 32): growth
            of the workers' resident memory (goal: < 50 MiB);
abort       1000 add / abort cycles at random points: state left in the engine, the scheduler and
            the workers (goal: none);
refused     every kind of bad update (unknown name, shape, dtype, NaN, a name twice, empty):
            refused, with the weights' checksum unchanged;
shm         /dev/shm bytes in use after 100 rollouts whose outputs the caller keeps.

  python -m benchmarks.faults --backends mp --json faults.json     # default: uni, mp and ray
"""

from __future__ import annotations

import operator
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import cloudpickle
import torch
from peft import LoraConfig

from benchmarks import harness
from benchmarks.harness import Target, positive_int
from benchmarks.lora_swap import make_adapters
from executors.shm import shm_dir
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.errors import EngineDeadError
from rollout.pipelines.loading import load_adapter
from rollout.pipelines.tiny import build_tiny_sd3
from rollout.weights.state import base_state, checksum

BACKENDS = ("uni", "mp", "ray")
PROCESS_BACKENDS = ("mp", "ray")
WORKERS = {"uni": 1, "mp": 2, "ray": 2}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
# The rollout a kill interrupts: four samples, so every rank has work (an idle Ray actor is not watched).
LONG_ROLLOUT = SamplingParams(num_inference_steps=500, num_samples=4)


def rss_mib(worker) -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def slow_down(worker, target: str, seconds: float) -> None:
    """Make `worker.<target>` (a dotted path to a method) take `seconds` longer."""
    owner_path, _, name = target.rpartition(".")
    owner = operator.attrgetter(owner_path)(worker) if owner_path else worker
    original = getattr(owner, name)

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    setattr(owner, name, slow)


def transformer_weights(worker) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in base_state(worker.adapter.transformer).items()}


def config_for(model: str, backend: str, **settings) -> EngineConfig:
    return EngineConfig(model=model, executor=backend, num_workers=WORKERS[backend], **settings)


def kill_figures(model: str, backend: str) -> dict:
    """Seconds from a SIGKILL of rank 1 to EngineDeadError, per phase, and what was left."""
    figures = {}
    # phase -> (worker method made slower, by how many seconds, the call the kill interrupts)
    phases = {
        "rollout": ("runner.step", 0.2, lambda engine, weights: engine.generate("x", LONG_ROLLOUT)),
        "update": ("updates.stage", 30.0, lambda engine, weights: engine.update_weights(weights)),
        "rpc": (None, 0.0, lambda engine, weights: engine.collective_rpc(lambda worker: time.sleep(60))),
    }
    for phase, (slowed, seconds_longer, call) in phases.items():
        before = set(shm_dir().glob(f"rollout-{os.getpid()}-*"))
        engine = RolloutEngine(config_for(model, backend))
        pids = engine.collective_rpc(lambda worker: os.getpid())
        weights = engine.collective_rpc(transformer_weights)[0]
        if slowed is not None:
            engine.collective_rpc(slow_down, args=(slowed, seconds_longer))
        killed_at: list[float] = []
        killer = threading.Timer(1.0, _kill, args=(pids[1], killed_at))
        killer.start()
        try:
            call(engine, weights)
            seconds = None  # the call returned: the kill went unnoticed
        except EngineDeadError:
            seconds = time.monotonic() - killed_at[0]
        killer.join()
        engine.shutdown()
        time.sleep(0.5)
        left = [pid for pid in pids if _alive(pid)]
        blocks = set(shm_dir().glob(f"rollout-{os.getpid()}-*")) - before
        figures[phase] = {"seconds_to_error": seconds, "processes_left": len(left), "shm_blocks_left": len(blocks)}
    return figures


def _kill(pid: int, killed_at: list[float]) -> None:
    killed_at.append(time.monotonic())
    os.kill(pid, signal.SIGKILL)


def lora_figures(model: str, backend: str, cycles: int) -> dict:
    """Worker resident memory growth over load / hot-swap / unload cycles of two layouts."""
    transformer = load_adapter(model).transformer
    configs = [LoraConfig(r=r, lora_alpha=r, target_modules=LORA_TARGETS, init_lora_weights=False) for r in (64, 32)]
    adapters = [(make_adapters(transformer, config, count=1)[0], config) for config in configs]
    with RolloutEngine(config_for(model, backend)) as engine:
        for _ in range(20):  # warm up allocator pools
            engine.load_lora("cycle", *adapters[0])
            engine.unload_lora("cycle")
        before = engine.collective_rpc(rss_mib)
        start = time.perf_counter()
        for _ in range(cycles):
            engine.load_lora("cycle", *adapters[0])
            engine.load_lora("cycle", *adapters[1])  # a hot swap to the other layout
            engine.unload_lora("cycle")
        seconds = time.perf_counter() - start
        growth = max(a - b for a, b in zip(engine.collective_rpc(rss_mib), before, strict=True))
    return {"cycles": cycles, "rss_growth_mib": growth, "ms_per_cycle": 1000 * seconds / cycles}


def abort_figures(model: str, backend: str, cycles: int) -> dict:
    """State left after add / abort cycles at random points of the requests' lives."""
    rng = random.Random(0)
    with RolloutEngine(config_for(model, backend)) as engine:
        start = time.perf_counter()
        for cycle in range(cycles):
            params = SamplingParams(num_inference_steps=4, num_samples=rng.randint(1, 3), seed=cycle)
            engine.add_request("x", params, request_id=f"c{cycle}")
            for _ in range(rng.randint(0, 3)):
                engine.step()
            engine.abort(f"c{cycle}")
        seconds = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        left = {
            "engine": len(engine.scheduler.requests),
            "scheduler": len(engine.scheduler.waiting) + len(engine.scheduler.running),
            "workers": sum(len(ids) for ids in engine.collective_rpc("request_ids")),
        }
    return {"cycles": cycles, "left": left, "ms_per_cycle": 1000 * seconds / cycles}


def refused_figures(model: str, backend: str) -> dict:
    """Each kind of bad update: refused (ValueError) with the checksum unchanged."""
    with RolloutEngine(config_for(model, backend)) as engine:
        weights = engine.collective_rpc(transformer_weights)[0]
        digest = engine.weights_checksum()
        name, tensor = next((n, t) for n, t in weights.items() if t.ndim == 2)
        bad = {
            "unknown name": {"no.such.weight": tensor},
            "wrong shape": {name: tensor[:1]},
            "wrong dtype": {name: tensor.double()},
            "NaN": {name: torch.full_like(tensor, float("nan"))},
            "empty": {},
            "a name twice": [(name, tensor), (name, tensor)],
        }
        results = {}
        for kind, update in bad.items():
            try:
                engine.update_weights(update, check_finite=True)
                refused = False
            except ValueError:
                refused = True
            results[kind] = {"refused": refused, "checksum_unchanged": engine.weights_checksum() == digest}
        assert checksum(weights) == digest
    return results


def shm_figures(model: str, backend: str, rollouts: int) -> dict:
    """/dev/shm bytes in use while the caller keeps every rollout's outputs."""
    with RolloutEngine(config_for(model, backend)) as engine:
        params = SamplingParams(num_inference_steps=3, num_samples=4, seed=0)
        engine.generate(["warm", "up"], params)  # the measured calls' size: reply blocks grow to fit here
        before = _shm_used()
        kept = [engine.generate(["a", "b"], params) for _ in range(rollouts)]
        grown = _shm_used() - before
        held = sum(o.trajectory.latents.nbytes + o.image.nbytes for outputs in kept for o in outputs)
    return {"rollouts": rollouts, "outputs_mib": held / 2**20, "shm_growth_mib": grown / 2**20}


def _shm_used() -> int:
    stats = os.statvfs(shm_dir())
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie answers kill(0) but has exited


def report_figures(results: dict, report: harness.Report) -> None:
    report.results = results
    kills = [(backend, phase, kill) for backend, f in results.items() for phase, kill in f.get("kill", {}).items()]
    if kills:
        report.table(
            "kill: a worker SIGKILLed mid-call (goal: EngineDeadError within 5 s, no process or shm block left)",
            ["backend", "phase", "EngineDeadError after s", "processes left", "shm blocks left"],
            [[b, f"mid-{phase}", *(("not noticed" if v is None else v) for v in k.values())] for b, phase, k in kills],
        )
    for backend, phase, kill in kills:
        seconds = float("inf") if kill["seconds_to_error"] is None else kill["seconds_to_error"]
        report.check(Target(f"{backend} kill mid-{phase}: s to EngineDeadError", seconds, "<=", 5))
        left = kill["processes_left"] + kill["shm_blocks_left"]
        report.check(Target(f"{backend} kill mid-{phase}: processes + shm blocks left", left, "==", 0))
    rows = []
    for backend, f in results.items():
        lora, abort, shm, refused = f["lora"], f["abort"], f["shm"], f["refused"]
        wrong = [kind for kind, r in refused.items() if not (r["refused"] and r["checksum_unchanged"])]
        ok = len(refused) - len(wrong)
        left = "/".join(str(n) for n in abort["left"].values())
        rows.append([backend, lora["rss_growth_mib"], lora["ms_per_cycle"], left, abort["ms_per_cycle"]])
        rows[-1] += [f"{ok} of {len(refused)}", shm["outputs_mib"], shm["shm_growth_mib"]]
        report.check(Target(f"{backend} lora: resident memory growth MiB", lora["rss_growth_mib"], "<", 50))
        report.check(Target(f"{backend} abort: state left", sum(abort["left"].values()), "==", 0))
        report.check(Target(f"{backend} bad updates refused, checksum unchanged", ok, "==", len(refused)))
        if wrong:
            report.note(f"{backend}: bad updates not refused, or the checksum changed: {', '.join(wrong)}")
    report.table(
        "lora, abort, refused updates and /dev/shm per backend",
        ["backend", "lora RSS growth MiB", "ms/cycle", "abort left", "ms/cycle", "bad updates refused"]
        + ["outputs kept MiB", "/dev/shm growth MiB"],
        rows,
        note=f"lora: {lora['cycles']} load / hot-swap / unload cycles (rank 64 <-> 32); abort: {abort['cycles']} "
        "add / abort cycles, state left in engine/scheduler/workers;\nrefused: bad updates (unknown name, shape, "
        f"dtype, NaN, empty, a name twice) refused with the checksum unchanged; shm: {shm['rollouts']} rollouts kept",
    )


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser("faults", __doc__)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="backends to measure")
    parser.add_argument("--lora-cycles", type=positive_int, default=300, help="load / hot-swap / unload cycles")
    parser.add_argument("--abort-cycles", type=positive_int, default=1000, help="add / abort cycles")
    parser.add_argument("--rollouts", type=positive_int, default=100, help="rollouts whose outputs are kept (shm)")
    args = parser.parse_args(argv)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this module
    report = harness.Report("faults", args, __doc__, argv)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rollout-faults-") as folder:
        model = str(build_tiny_sd3(folder))
        for backend in args.backends:
            print(f"measuring {backend} ...", flush=True)
            results[backend] = {"kill": kill_figures(model, backend)} if backend in PROCESS_BACKENDS else {}
            results[backend]["lora"] = lora_figures(model, backend, args.lora_cycles)
            results[backend]["abort"] = abort_figures(model, backend, args.abort_cycles)
            results[backend]["refused"] = refused_figures(model, backend)
            results[backend]["shm"] = shm_figures(model, backend, args.rollouts)
    report_figures(results, report)
    return report.finish()


if __name__ == "__main__":
    main()
