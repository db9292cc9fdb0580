"""Fault figures: what a trainer that leaves the engine running for days relies on, per backend.

kill        a worker SIGKILLed mid-rollout, mid-update and mid-RPC: seconds until the call fails
            with EngineDeadError, and worker processes and /dev/shm blocks left afterwards
            (goal: <= 5 s, none left; mp and ray, which run workers in processes);
lora        300 load / hot-swap / unload cycles alternating two layouts (rank 64 and 32): growth
            of the workers' resident memory (goal: < 50 MiB);
abort       1000 add / abort cycles at random points: state left in the engine, the scheduler and
            the workers (goal: none);
refused     every kind of bad update (unknown name, shape, dtype, NaN, a name twice, empty):
            refused, with the weights' checksum unchanged;
shm         /dev/shm bytes in use after 100 rollouts whose outputs the caller keeps.

  python -m benchmarks.faults                      # uni, mp and ray
  python -m benchmarks.faults --backends mp --json faults.json
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import cloudpickle
import torch

from benchmarks.common import json_args, write_json
from executors.shm import shm_dir
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.errors import EngineDeadError
from rollout.pipelines.tiny import build_tiny_sd3
from rollout.weights import base_state, checksum

PROCESS_BACKENDS = ("mp", "ray")
WORKERS = {"uni": 1, "mp": 2, "ray": 2}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.faults",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--backends", nargs="+", choices=("uni", "mp", "ray"), default=["uni", "mp", "ray"])
    parser.add_argument("--lora-cycles", type=int, default=300, help="load / hot-swap / unload cycles")
    parser.add_argument("--abort-cycles", type=int, default=1000, help="add / abort cycles")
    parser.add_argument("--rollouts", type=int, default=100, help="rollouts whose outputs are kept (shm)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    return parser.parse_args(argv)


# Worker functions (sent by value: Ray workers cannot import this module).


def worker_pid(worker) -> int:
    return os.getpid()


def rss_mib(worker) -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def slow_down(worker, target: str, seconds: float) -> None:
    """Make `worker.<target>` (a dotted path to a method) take `seconds` longer."""
    owner_path, _, name = target.rpartition(".")
    owner = worker
    for part in owner_path.split(".") if owner_path else []:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    setattr(owner, name, slow)


def transformer_weights(worker) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in base_state(worker.adapter.transformer).items()}


# The figures.


def config_for(model: str, backend: str, **settings) -> EngineConfig:
    return EngineConfig(model=model, executor=backend, num_workers=WORKERS[backend], **settings)


def kill_figures(model: str, backend: str) -> dict:
    """Seconds from a SIGKILL of rank 1 to EngineDeadError, per phase, and what was left."""
    figures = {}
    # phase -> (worker method made slower, by how many seconds, the call the kill interrupts)
    phases = {
        "rollout": ("runner.step", 0.2, _rollout),
        "update": ("updates.stage", 30.0, lambda engine, weights: engine.update_weights(weights)),
        "rpc": (None, 0.0, lambda engine, weights: engine.collective_rpc(lambda worker: time.sleep(60))),
    }
    for phase, (slowed, seconds_longer, call) in phases.items():
        before = set(shm_dir().glob(f"rollout-{os.getpid()}-*"))
        engine = RolloutEngine(config_for(model, backend))
        pids = engine.collective_rpc(worker_pid)
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


def _rollout(engine: RolloutEngine, weights) -> None:
    # Four samples: every rank has work (an idle Ray actor is not called, so not watched).
    engine.generate("x", SamplingParams(num_inference_steps=500, num_samples=4))


def _kill(pid: int, killed_at: list[float]) -> None:
    killed_at.append(time.monotonic())
    os.kill(pid, signal.SIGKILL)


def lora_figures(model: str, backend: str, cycles: int) -> dict:
    """Worker resident memory growth over load / hot-swap / unload cycles of two layouts."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from rollout.pipelines.loading import load_adapter

    transformer = load_adapter(model).transformer
    adapters = []
    for rank in (64, 32):
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS, init_lora_weights=False)
        with warnings.catch_warnings():  # PEFT warns about a second adapter; two is the point here
            warnings.simplefilter("ignore", UserWarning)
            transformer.add_adapter(config, adapter_name=f"r{rank}")
        tensors = get_peft_model_state_dict(transformer, adapter_name=f"r{rank}")
        adapters.append(({k: v.detach().clone() for k, v in tensors.items()}, config))
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
        engine.generate("warm up", params)
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
    with open(f"/proc/{pid}/stat") as stat:  # a zombie answers kill(0) but has exited
        return stat.read().split()[2] != "Z"


def print_report(results: dict) -> None:
    print()
    for backend, figures in results.items():
        print(f"== {backend}")
        for phase, kill in figures.get("kill", {}).items():
            seconds = kill["seconds_to_error"]
            shown = "not noticed" if seconds is None else f"{seconds:.2f} s"
            ok = seconds is not None and seconds <= 5 and not kill["processes_left"] and not kill["shm_blocks_left"]
            print(
                f"  kill mid-{phase:<8} EngineDeadError after {shown:>8}; processes left {kill['processes_left']}, "
                f"shm blocks left {kill['shm_blocks_left']}   goal <= 5 s, none left: {'met' if ok else 'MISSED'}"
            )
        lora = figures["lora"]
        growth = lora["rss_growth_mib"]
        print(
            f"  lora      {lora['cycles']} cycles (rank 64 <-> 32): resident memory +{growth:.1f} MiB, "
            f"{lora['ms_per_cycle']:.1f} ms/cycle   goal < 50 MiB: {'met' if growth < 50 else 'MISSED'}"
        )
        abort = figures["abort"]
        clean = not any(abort["left"].values())
        print(
            f"  abort     {abort['cycles']} add/abort cycles: left {abort['left']}, "
            f"{abort['ms_per_cycle']:.1f} ms/cycle   goal none: {'met' if clean else 'MISSED'}"
        )
        refused = figures["refused"]
        all_ok = all(r["refused"] and r["checksum_unchanged"] for r in refused.values())
        kinds = ", ".join(kind for kind, r in refused.items() if r["refused"] and r["checksum_unchanged"])
        print(f"  refused   {kinds}   all refused, checksum unchanged: {'met' if all_ok else 'MISSED'}")
        shm = figures["shm"]
        print(
            f"  shm       {shm['rollouts']} rollouts kept ({shm['outputs_mib']:.1f} MiB of outputs): "
            f"/dev/shm +{shm['shm_growth_mib']:.2f} MiB"
        )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rollout-faults-") as folder:
        model = str(build_tiny_sd3(folder))
        for backend in args.backends:
            print(f"measuring {backend} ...", flush=True)
            figures = {}
            if backend in PROCESS_BACKENDS:
                figures["kill"] = kill_figures(model, backend)
            figures["lora"] = lora_figures(model, backend, args.lora_cycles)
            figures["abort"] = abort_figures(model, backend, args.abort_cycles)
            figures["refused"] = refused_figures(model, backend)
            figures["shm"] = shm_figures(model, backend, args.rollouts)
            results[backend] = figures
    print_report(results)
    result = {"args": json_args(args), "results": results}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
