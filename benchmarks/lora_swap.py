"""LoRA swap: milliseconds to replace, switch and load a LoRA adapter, engine vs. plain diffusers.

Builds the tiny SD3 pipeline (`rollout.pipelines.tiny`, random weights) in a temporary folder and
makes two random rank-`--rank` adapters on the attention projections with PEFT
(`init_lora_weights=False`, so both matrices are non-zero and every swap changes the outputs). Each
adapter is also saved as a PEFT folder (adapter_config.json + adapter_model.safetensors, keys
`base_model.model.*`) and as a diffusers LoRA folder (pytorch_lora_weights.safetensors, keys
`transformer.*`). Then it measures, one operation each:

  swap uni / swap mp
            `engine.load_lora("policy", tensors, config)` while "policy" is loaded: the trainer's
            per-step push of new LoRA weights (a hot swap), executor "uni" and "mp" (1 worker);
  folder swap uni
            `engine.load_lora("policy", peft_folder)`: the same hot swap, read from disk by the worker;
  folder load+unload uni
            `engine.load_lora("fresh", peft_folder)` then `engine.unload_lora("fresh")`: a new name
            (like for like with diffusers below);
  diffusers load+delete
            `pipeline.load_lora_weights(diffusers_folder, adapter_name="fresh")` then
            `pipeline.delete_adapters("fresh")` on a `StableDiffusion3Pipeline` in this process:
            the baseline, what a trainer does without the engine;
  diffusers hotswap
            `pipeline.load_lora_weights(diffusers_folder, adapter_name="policy", hotswap=True)`:
            diffusers' own in-place replacement (reference, no target);
  copy floor
            `param.copy_(tensor)` of every LoRA tensor into a resident adapter's parameters: what
            any hot swap must at least spend.

Each round runs every mode once, in a rotated order, and alternates the two adapters, so every swap
changes the weights; after each operation (outside the timed region) the weights the engine or
pipeline holds are compared bitwise with what was sent. Warmup rounds are discarded and medians
are reported. Then, on "uni" with two adapters resident ("a" and "b"), a run of 1-step generate
calls with `SamplingParams(lora=...)` in the pattern a a b b a a b b ... measures the latency a
switch adds: calls whose adapter differs from the previous call's pay `set_adapters`, the others
do not; the worker's `LoraManager.activate` is also timed alone. Last, timers inside the worker
split a hot swap into its pieces (key checks, delete_adapters, add_adapter, set_peft_model_state_dict,
counting bound modules). Target: a hot swap (uni and mp) under 50 ms.

    python -m benchmarks.lora_swap                     # rank 32, 2 warmup + 50 rounds
    python -m benchmarks.lora_swap --repeats 20 --no-mp --json out.json

The file is past ~400 lines because it holds seven modes, the switch test and the breakdown, each a
small function; splitting them over files would scatter one measurement.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import install_timers, interleaved_rounds, json_args, remove_timers, spread, write_json
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.tiny import build_tiny_sd3

# Attention projections of SD3Transformer2DModel's joint blocks (the last block has no
# `to_add_out`: its context stream stops after attention).
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
MODES = ("swap_uni", "swap_mp", "folder_swap_uni", "folder_load_unload_uni", "diffusers", "diffusers_hotswap", "floor")
MODE_LABELS = {
    "swap_uni": "swap uni (tensors, same name)",
    "swap_mp": "swap mp (tensors, same name)",
    "folder_swap_uni": "folder swap uni (PEFT folder, same name)",
    "folder_load_unload_uni": "folder load+unload uni (new name)",
    "diffusers": "diffusers load+delete (baseline)",
    "diffusers_hotswap": "diffusers hotswap=True",
    "floor": "copy floor (param.copy_)",
}
BASELINE = "diffusers"
# The project's target: a hot swap of a rank-32 adapter on the tiny model.
TARGET_SWAP_MS = 50.0
TARGETED_MODES = ("swap_uni", "swap_mp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lora_swap",
        description=__doc__.split("\n\n")[0]
        + " Prints a table of ms per operation with the speedup over diffusers' load+delete, the"
        " latency a per-request adapter switch adds to generate, and where a hot swap spends its time.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = parser.add_argument_group("what to run")
    run.add_argument("--rank", type=int, default=32, help="LoRA rank r (lora_alpha = r)")
    run.add_argument("--repeats", type=int, default=50, help="timed rounds; each runs every mode once")
    run.add_argument("--warmup", type=int, default=2, help="untimed rounds first (allocator, first calls)")
    run.add_argument(
        "--switch-calls", type=int, default=200, help="timed 1-step generate calls for the adapter-switch test"
    )
    run.add_argument(
        "--activate-calls", type=int, default=200, help="timed LoraManager.activate calls in the worker (a<->b)"
    )
    run.add_argument("--breakdown-swaps", type=int, default=20, help="hot swaps timed piece by piece (0: skip)")
    run.add_argument("--no-mp", action="store_true", help="skip the mp engine (no worker process)")
    run.add_argument("--no-verify", action="store_true", help="do not compare the held weights after each operation")
    run.add_argument("--prompt", default="a red cube on a blue table", help="prompt of the adapter-switch test")
    run.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    positive = ("rank", "repeats", "switch_calls", "activate_calls")
    bad = [f"--{name.replace('_', '-')}" for name in positive if getattr(args, name) < 1]
    if bad or args.warmup < 0 or args.breakdown_swaps < 0:
        parser.error(f"{', '.join(bad) or 'these options'} must be >= 1 (and --warmup, --breakdown-swaps >= 0)")
    return args


# PEFT warns on every delete of the active adapter and on every second adapter; here that is every
# operation, so the benchmark silences those two (in this process and in every worker).
_PEFT_NOISE = ("Adapter .* was active which is now deleted", "Already found a `peft_config` attribute")


def quiet_peft_warnings(worker=None) -> None:
    for message in _PEFT_NOISE:
        warnings.filterwarnings("ignore", message=message)


# Adapters and their files.


def make_adapters(transformer, config, count: int = 2) -> list[dict[str, torch.Tensor]]:
    """`count` random adapters as PEFT state dicts (`transformer_blocks.0.attn.to_q.lora_A.weight`),
    made on `transformer` and deleted from it again."""
    from peft.utils import get_peft_model_state_dict

    adapters = []
    for seed in range(count):
        torch.manual_seed(seed)
        transformer.add_adapter(config, adapter_name=f"bench{seed}")
        state = get_peft_model_state_dict(transformer, adapter_name=f"bench{seed}")
        adapters.append({key: tensor.detach().clone() for key, tensor in state.items()})
        transformer.delete_adapters(f"bench{seed}")
    return adapters


def save_peft_folder(folder: Path, tensors: dict[str, torch.Tensor], config) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config.save_pretrained(str(folder))
    prefixed = {f"base_model.model.{key}": tensor.contiguous() for key, tensor in tensors.items()}
    save_file(prefixed, folder / "adapter_model.safetensors")
    return folder


def save_diffusers_folder(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    prefixed = {f"transformer.{key}": tensor.contiguous() for key, tensor in tensors.items()}
    save_file(prefixed, folder / "pytorch_lora_weights.safetensors")
    return folder


# Checks, run in the worker (any executor) or on the baseline pipeline; never timed.


def _held(transformer, name: str) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer, adapter_name=name)


def _holds(transformer, name: str, expected: dict[str, torch.Tensor]) -> bool:
    held = _held(transformer, name)
    return held.keys() == expected.keys() and all(torch.equal(held[k], expected[k]) for k in expected)


def _worker_holds(worker, name: str, expected: dict[str, torch.Tensor]) -> bool:
    return _holds(worker.adapter.transformer, name, expected)


def check_engine(engine: RolloutEngine, name: str, expected: dict[str, torch.Tensor]) -> None:
    if not all(engine.collective_rpc(_worker_holds, args=(name, expected))):
        raise AssertionError(f"engine adapter {name!r} does not hold the tensors just loaded")


def check_pipeline(pipeline, name: str, expected: dict[str, torch.Tensor]) -> None:
    if not _holds(pipeline.transformer, name, expected):
        raise AssertionError(f"diffusers adapter {name!r} does not hold the tensors just loaded")


# The modes. Each `make_*` does the untimed setup and returns `run(round_index) -> {phase: seconds}`;
# the operation's time is the sum of its phases.


def make_engine_swap(engine: RolloutEngine, adapters: list, config: dict, verify: bool) -> Callable[[int], dict]:
    engine.load_lora("policy", adapters[1], config)

    def run(round_index: int) -> dict:
        tensors = adapters[round_index % 2]
        start = time.perf_counter()
        engine.load_lora("policy", tensors, config)
        elapsed = time.perf_counter() - start
        if verify:
            check_engine(engine, "policy", tensors)
        return {"load_lora": elapsed}

    return run


def make_engine_folder_swap(engine: RolloutEngine, folders: list[Path], adapters: list, verify: bool):
    engine.load_lora("policy_from_folder", str(folders[1]))

    def run(round_index: int) -> dict:
        start = time.perf_counter()
        engine.load_lora("policy_from_folder", str(folders[round_index % 2]))
        elapsed = time.perf_counter() - start
        if verify:
            check_engine(engine, "policy_from_folder", adapters[round_index % 2])
        return {"load_lora": elapsed}

    return run


def make_engine_folder_load_unload(engine: RolloutEngine, folders: list[Path], adapters: list, verify: bool):
    def run(round_index: int) -> dict:
        start = time.perf_counter()
        engine.load_lora("fresh", str(folders[round_index % 2]))
        loaded = time.perf_counter()
        if verify:
            check_engine(engine, "fresh", adapters[round_index % 2])
        unload_start = time.perf_counter()
        engine.unload_lora("fresh")
        return {"load_lora": loaded - start, "unload_lora": time.perf_counter() - unload_start}

    return run


def make_diffusers_load_delete(pipeline, folders: list[Path], adapters: list, verify: bool):
    def run(round_index: int) -> dict:
        start = time.perf_counter()
        pipeline.load_lora_weights(str(folders[round_index % 2]), adapter_name="fresh")
        loaded = time.perf_counter()
        if verify:
            check_pipeline(pipeline, "fresh", adapters[round_index % 2])
        delete_start = time.perf_counter()
        pipeline.delete_adapters("fresh")
        return {"load_lora_weights": loaded - start, "delete_adapters": time.perf_counter() - delete_start}

    return run


def make_diffusers_hotswap(pipeline, folders: list[Path], adapters: list, verify: bool):
    pipeline.load_lora_weights(str(folders[1]), adapter_name="policy")

    def run(round_index: int) -> dict:
        start = time.perf_counter()
        pipeline.load_lora_weights(str(folders[round_index % 2]), adapter_name="policy", hotswap=True)
        elapsed = time.perf_counter() - start
        if verify:
            check_pipeline(pipeline, "policy", adapters[round_index % 2])
        return {"load_lora_weights": elapsed}

    return run


def make_copy_floor(pipeline, adapters: list, verify: bool) -> Callable[[int], dict]:
    """Copies into the parameters of the pipeline's resident "policy" adapter (the hotswap mode's)."""
    modules = dict(pipeline.transformer.named_modules())
    targets = {}
    for key in adapters[0]:
        module_name, rest = key.split(".lora_")
        layer = "lora_A" if rest.startswith("A.") else "lora_B"
        targets[key] = getattr(modules[module_name], layer)["policy"].weight

    def run(round_index: int) -> dict:
        tensors = adapters[round_index % 2]
        start = time.perf_counter()
        with torch.no_grad():
            for key, target in targets.items():
                target.copy_(tensors[key])
        elapsed = time.perf_counter() - start
        if verify:
            check_pipeline(pipeline, "policy", tensors)
        return {"copy_": elapsed}

    return run


def time_rounds(runs: dict[str, Callable[[int], dict]], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Phase seconds per operation for each mode; round r runs the modes rotated by r."""
    times: dict[str, list[dict]] = {mode: [] for mode in runs}
    for round_ in interleaved_rounds(runs, args.warmup, args.repeats):
        gc.collect()
        for mode in round_.order:
            phases = runs[mode](round_.index)
            if round_.timed:
                times[mode].append(phases)
        timed_rounds = round_.index + 1 - args.warmup
        if timed_rounds > 0 and (timed_rounds % 10 == 0 or timed_rounds == args.repeats):
            latest = "  ".join(f"{mode} {1e3 * sum(times[mode][-1].values()):.1f}" for mode in runs)
            print(f"  [round {timed_rounds}/{args.repeats}] ms: {latest}", flush=True)
    return times


# Switching between resident adapters, on uni.


def _time_activate(worker, names: list[str], calls: int) -> list[float]:
    """Seconds of each `LoraManager.activate` call, alternating between `names` (every call a switch)."""
    seconds = []
    for index in range(calls):
        start = time.perf_counter()
        worker.loras.activate(names[index % len(names)], 1.0)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure_switching(engine: RolloutEngine, adapters: list, config: dict, args: argparse.Namespace) -> dict:
    """Latency of 1-step generate calls whose adapter differs from the previous call's ("switch")
    or not ("same"), pattern a a b b ...; and `activate` alone in the worker."""
    engine.load_lora("a", adapters[0], config)
    engine.load_lora("b", adapters[1], config)
    pattern = ("a", "a", "b", "b")
    warmup = len(pattern) * 2
    calls: dict[str, list[float]] = {"same": [], "switch": []}
    pair_differences = []  # a switch call minus the same-adapter call right after it
    previous = None
    for index in range(warmup + args.switch_calls):
        lora = pattern[index % len(pattern)]
        params = SamplingParams(num_inference_steps=1, seed=index, lora=lora, return_trajectory=False)
        if index % 20 == 0:
            gc.collect()  # between calls, not inside one
        start = time.perf_counter()
        outputs = engine.generate([args.prompt], params)
        elapsed = time.perf_counter() - start
        assert outputs[0].lora == lora
        if index >= warmup:
            switched = lora != previous
            calls["switch" if switched else "same"].append(elapsed)
            if not switched and index > warmup:
                pair_differences.append(calls["switch"][-1] - elapsed)
        previous = lora
    activate = engine.collective_rpc(_time_activate, args=(["a", "b"], args.activate_calls))[0]
    engine.unload_lora("a")
    engine.unload_lora("b")
    same, switch = statistics.median(calls["same"]), statistics.median(calls["switch"])
    return {
        "same_ms": 1e3 * same,
        "switch_ms": 1e3 * switch,
        "added_ms": 1e3 * (switch - same),
        "added_per_pair_ms": 1e3 * statistics.median(pair_differences),
        "same_calls": len(calls["same"]),
        "switch_calls": len(calls["switch"]),
        "activate_ms": 1e3 * statistics.median(activate),
        "activate_min_ms": 1e3 * min(activate),
        "same_times_s": calls["same"],
        "switch_times_s": calls["switch"],
    }


# The breakdown: timers around the pieces of `LoraManager.load` (see benchmarks.common.install_timers;
# the executors call worker methods through the class, so the outermost timer is LoraManager.load).
_TIMED_PIECES = (
    ("LoraManager.load", "loras.load"),
    ("normalize_keys", "rollout.lora:normalize_keys"),
    ("_check_fits", "loras._check_fits"),
    ("unload (old adapter)", "loras.unload"),
    ("delete_adapters", "adapter.transformer.delete_adapters"),
    ("add_adapter", "adapter.transformer.add_adapter"),
    ("set_peft_model_state_dict", "rollout.lora:set_peft_model_state_dict"),
    ("bound_modules", "loras.bound_modules"),
)


def swap_breakdown(engine: RolloutEngine, adapters: list, config: dict, swaps: int) -> dict:
    """Median ms per piece of a hot swap (pieces nest: unload holds delete_adapters)."""
    engine.collective_rpc(install_timers, args=(_TIMED_PIECES,))
    walls = []
    try:
        for index in range(swaps):
            start = time.perf_counter()
            engine.load_lora("policy", adapters[index % 2], config)
            walls.append(time.perf_counter() - start)
    finally:
        totals = engine.collective_rpc(remove_timers)[0]
    pieces = {name: 1e3 * statistics.median(values) for name, values in totals.items() if values}
    pieces["engine + executor (outside LoraManager.load)"] = 1e3 * statistics.median(
        w - s for w, s in zip(walls, totals["LoraManager.load"], strict=True)
    )
    return {"wall_ms": 1e3 * statistics.median(walls), "pieces_ms": pieces}


# Reporting.


def summarize(times: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for mode, rounds in times.items():
        totals = [sum(phases.values()) for phases in rounds]
        summary[mode] = {
            **spread(totals, unit="ms", scale=1e3),
            "phases_median_ms": {phase: 1e3 * statistics.median(r[phase] for r in rounds) for phase in rounds[0]},
            "times_s": totals,
        }
    return summary


def print_report(
    summary: dict[str, dict], switching: dict, breakdowns: dict[str, dict], adapter_info: dict, repeats: int
) -> None:
    base = summary[BASELINE]["median_ms"]
    label = f"operation (median of {repeats})"
    header = f"{label:<42} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'x faster':>9}   target"
    print("\n" + header)
    print("-" * len(header))
    for mode in MODES:
        if mode not in summary:
            continue
        row = summary[mode]
        target = ""
        if mode in TARGETED_MODES:
            ok = row["median_ms"] < TARGET_SWAP_MS
            target = f"< {TARGET_SWAP_MS:.0f} ms: {'met' if ok else 'MISSED'}"
        print(
            f"{MODE_LABELS[mode]:<42} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f} {row['max_ms']:>8.2f} "
            f"{base / row['median_ms']:>9.2f}   {target}"
        )
    print("  (x faster: diffusers load+delete median / this median)")
    split = [m for m in MODES if m in summary and len(summary[m]["phases_median_ms"]) > 1]
    for mode in split:
        phases = ", ".join(f"{p} {ms:.2f} ms" for p, ms in summary[mode]["phases_median_ms"].items())
        print(f"  {MODE_LABELS[mode]}: {phases}")
    for label, mode in (("swap uni", "swap_uni"), ("swap mp", "swap_mp"), ("folder swap uni", "folder_swap_uni")):
        if mode in summary:
            print(f"  {label} / copy floor: {summary[mode]['median_ms'] / summary['floor']['median_ms']:.0f}x")

    print(
        f"\nadapter switch on uni, 1-step generate (batch 1, CFG), pattern a a b b: "
        f"{switching['same_calls']} same + {switching['switch_calls']} switch calls"
    )
    print(f"  same adapter as the previous call   {switching['same_ms']:>8.2f} ms (median)")
    print(f"  other adapter (set_adapters)        {switching['switch_ms']:>8.2f} ms (median)")
    print(f"  added by a switch (medians)         {switching['added_ms']:>8.2f} ms")
    print(f"  added, median over adjacent pairs   {switching['added_per_pair_ms']:>8.2f} ms (switch call - next call)")
    print(
        f"  LoraManager.activate a<->b alone    {switching['activate_ms']:>8.2f} ms (median; min "
        f"{switching['activate_min_ms']:.2f})"
    )

    for backend, breakdown in breakdowns.items():
        swaps, wall = breakdown["swaps"], breakdown["wall_ms"]
        print(f"\nhot swap breakdown on {backend} (medians of {swaps} swaps, {wall:.2f} ms wall):")
        for name, ms in breakdown["pieces_ms"].items():
            print(f"  {name:<46} {ms:>8.2f} ms")
        print("  (nested: LoraManager.load holds the pieces below it; unload holds delete_adapters)")

    print(
        f"\nadapter: rank {adapter_info['rank']}, {adapter_info['modules']} modules, "
        f"{adapter_info['parameters']:,} parameters ({adapter_info['bytes'] / 1024:.0f} KiB float32); "
        f"transformer: {adapter_info['transformer_parameters']:,} parameters"
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from diffusers import StableDiffusion3Pipeline
    from diffusers.utils import logging as diffusers_logging
    from peft import LoraConfig

    diffusers_logging.set_verbosity_error()
    quiet_peft_warnings()
    verify = not args.no_verify
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpu, float32")
    print(f"rank {args.rank}, rounds {args.warmup} warmup + {args.repeats} timed, verify {verify}")
    with tempfile.TemporaryDirectory(prefix="rollout-bench-lora-") as tmp:
        model = build_tiny_sd3(Path(tmp) / "model", seed=0)
        pipeline = StableDiffusion3Pipeline.from_pretrained(
            str(model), text_encoder_3=None, tokenizer_3=None, local_files_only=True
        )
        pipeline.set_progress_bar_config(disable=True)
        peft_config = LoraConfig(
            r=args.rank, lora_alpha=args.rank, target_modules=LORA_TARGETS, init_lora_weights=False
        )
        adapters = make_adapters(pipeline.transformer, peft_config)
        config = {"r": args.rank, "lora_alpha": args.rank, "target_modules": LORA_TARGETS}
        peft_folders = [save_peft_folder(Path(tmp) / f"peft{i}", a, peft_config) for i, a in enumerate(adapters)]
        diffusers_folders = [save_diffusers_folder(Path(tmp) / f"diffusers{i}", a) for i, a in enumerate(adapters)]
        adapter_info = {
            "rank": args.rank,
            "modules": len({key.split(".lora_")[0] for key in adapters[0]}),
            "parameters": sum(t.numel() for t in adapters[0].values()),
            "bytes": sum(t.numel() * t.element_size() for t in adapters[0].values()),
            "transformer_parameters": sum(p.numel() for p in pipeline.transformer.parameters()),
        }
        print(
            f"adapter: {adapter_info['modules']} modules, {adapter_info['parameters']:,} parameters; "
            f"transformer {adapter_info['transformer_parameters']:,} parameters"
        )

        engine_config = EngineConfig(model=str(model), executor="uni", max_batch_size=1)
        mp_config = EngineConfig(model=str(model), executor="mp", num_workers=1, max_batch_size=1)
        mp_engine = None if args.no_mp else RolloutEngine(mp_config)
        try:
            if mp_engine is not None:
                mp_engine.collective_rpc(quiet_peft_warnings)
            with RolloutEngine(engine_config) as engine:
                runs = {"swap_uni": make_engine_swap(engine, adapters, config, verify)}
                if mp_engine is not None:
                    runs["swap_mp"] = make_engine_swap(mp_engine, adapters, config, verify)
                runs["folder_swap_uni"] = make_engine_folder_swap(engine, peft_folders, adapters, verify)
                runs["folder_load_unload_uni"] = make_engine_folder_load_unload(engine, peft_folders, adapters, verify)
                runs["diffusers"] = make_diffusers_load_delete(pipeline, diffusers_folders, adapters, verify)
                runs["diffusers_hotswap"] = make_diffusers_hotswap(pipeline, diffusers_folders, adapters, verify)
                runs["floor"] = make_copy_floor(pipeline, adapters, verify)
                print(f"modes: {', '.join(runs)}")
                times = time_rounds(runs, args)
                engine.unload_lora("policy_from_folder")
                print("adapter switch test (uni) ...", flush=True)
                switching = measure_switching(engine, adapters, config, args)
                breakdowns = {}
                if args.breakdown_swaps:
                    targets = [("uni", engine)] + ([("mp", mp_engine)] if mp_engine is not None else [])
                    for backend, target in targets:
                        breakdowns[backend] = swap_breakdown(target, adapters, config, args.breakdown_swaps)
                        breakdowns[backend]["swaps"] = args.breakdown_swaps
        finally:
            if mp_engine is not None:
                mp_engine.shutdown()
    summary = summarize(times)
    print_report(summary, switching, breakdowns, adapter_info, args.repeats)
    result = {
        "args": json_args(args),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "adapter": adapter_info,
        "target_swap_ms": TARGET_SWAP_MS,
        "modes": summary,
        "speedup_vs_diffusers": {m: summary[BASELINE]["median_ms"] / s["median_ms"] for m, s in summary.items()},
        "switching": switching,
        "breakdown": breakdowns,
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
