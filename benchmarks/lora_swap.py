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
pipeline holds are compared bitwise with what was sent. Then, on "uni" with two adapters resident
("a" and "b"), a run of 1-step generate calls with `SamplingParams(lora=...)` in the pattern
a a b b a a b b ... measures the latency a switch adds: calls whose adapter differs from the
previous call's pay `set_adapters`, the others do not; the worker's `LoraManager.activate` is also
timed alone. Last, the engine's step observer (its RPCs) and worker timers split a hot swap into
its pieces (the stage and commit RPCs, the NaN/inf check, key checks, the copies into the live
layers, counting bound modules). Target: a hot swap (uni and mp) under 50 ms.

    python -m benchmarks.lora_swap                     # rank 32, 2 warmup + 50 rounds
    python -m benchmarks.lora_swap --repeats 20 --no-mp --json out.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.worker_timers import install_timers, remove_timers
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.tiny import build_tiny_sd3
from rollout.step_report import StepReport

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


def build_parser() -> argparse.ArgumentParser:
    parser = harness.parser("lora_swap", __doc__, repeats=50, warmup=2)
    run = parser.add_argument_group("what to run")
    run.add_argument("--rank", type=harness.positive_int, default=32, help="LoRA rank r (lora_alpha = r)")
    run.add_argument(
        "--switch-calls",
        type=harness.positive_int,
        default=200,
        help="timed 1-step generate calls for the adapter-switch test",
    )
    run.add_argument(
        "--activate-calls",
        type=harness.positive_int,
        default=200,
        help="timed LoraManager.activate calls in the worker (a<->b)",
    )
    run.add_argument(
        "--breakdown-swaps", type=harness.count, default=20, help="hot swaps timed piece by piece (0: skip)"
    )
    run.add_argument("--no-mp", action="store_true", help="skip the mp engine (no worker process)")
    run.add_argument("--no-verify", action="store_true", help="do not compare the held weights after each operation")
    run.add_argument("--prompt", default="a red cube on a blue table", help="prompt of the adapter-switch test")
    return parser


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


def _holds(transformer, name: str, expected: dict[str, torch.Tensor], layers: str | None = None) -> bool:
    """Whether adapter `name` (its PEFT layers named `layers`, by default `name`) holds `expected`."""
    from peft.utils import get_peft_model_state_dict

    held = get_peft_model_state_dict(transformer, adapter_name=layers or name)
    return held.keys() == expected.keys() and all(torch.equal(held[k], expected[k]) for k in expected)


def _worker_holds(worker, name: str, expected: dict[str, torch.Tensor]) -> bool:
    # The worker's LoraManager builds an adapter's layers under a PEFT name of their own.
    return _holds(worker.adapter.transformer, name, expected, worker.loras._layers[name])


def check_engine(engine: RolloutEngine, name: str, expected: dict[str, torch.Tensor]) -> None:
    if not all(engine.collective_rpc(_worker_holds, args=(name, expected))):
        raise AssertionError(f"engine adapter {name!r} does not hold the tensors just loaded")


def check_pipeline(pipeline, name: str, expected: dict[str, torch.Tensor]) -> None:
    if not _holds(pipeline.transformer, name, expected):
        raise AssertionError(f"diffusers adapter {name!r} does not hold the tensors just loaded")


# The modes. Each `make_*` does the untimed setup and returns, for `harness.run_rounds`, a function
# of the round that returns {phase: seconds}; the operation's time is the sum of its phases. Round r
# sends adapter r % 2, so every operation changes the weights.


def make_engine_swap(engine: RolloutEngine, adapters: list, config: dict, verify: bool) -> Callable:
    engine.load_lora("policy", adapters[1], config)

    def run(round_: harness.Round) -> dict:
        tensors = adapters[round_.index % 2]
        _, seconds = harness.timed_call(engine.load_lora, "policy", tensors, config)
        if verify:
            check_engine(engine, "policy", tensors)
        return {"load_lora": seconds}

    return run


def make_engine_folder_swap(engine: RolloutEngine, folders: list[Path], adapters: list, verify: bool) -> Callable:
    engine.load_lora("policy_from_folder", str(folders[1]))

    def run(round_: harness.Round) -> dict:
        _, seconds = harness.timed_call(engine.load_lora, "policy_from_folder", str(folders[round_.index % 2]))
        if verify:
            check_engine(engine, "policy_from_folder", adapters[round_.index % 2])
        return {"load_lora": seconds}

    return run


def make_engine_folder_load_unload(engine: RolloutEngine, folders: list[Path], adapters: list, verify: bool):
    def run(round_: harness.Round) -> dict:
        _, load = harness.timed_call(engine.load_lora, "fresh", str(folders[round_.index % 2]))
        if verify:
            check_engine(engine, "fresh", adapters[round_.index % 2])
        _, unload = harness.timed_call(engine.unload_lora, "fresh")
        return {"load_lora": load, "unload_lora": unload}

    return run


def make_diffusers_load_delete(pipeline, folders: list[Path], adapters: list, verify: bool) -> Callable:
    def run(round_: harness.Round) -> dict:
        _, load = harness.timed_call(
            lambda: pipeline.load_lora_weights(str(folders[round_.index % 2]), adapter_name="fresh")
        )
        if verify:
            check_pipeline(pipeline, "fresh", adapters[round_.index % 2])
        _, delete = harness.timed_call(pipeline.delete_adapters, "fresh")
        return {"load_lora_weights": load, "delete_adapters": delete}

    return run


def make_diffusers_hotswap(pipeline, folders: list[Path], adapters: list, verify: bool) -> Callable:
    pipeline.load_lora_weights(str(folders[1]), adapter_name="policy")

    def run(round_: harness.Round) -> dict:
        folder = str(folders[round_.index % 2])
        _, seconds = harness.timed_call(
            lambda: pipeline.load_lora_weights(folder, adapter_name="policy", hotswap=True)
        )
        if verify:
            check_pipeline(pipeline, "policy", adapters[round_.index % 2])
        return {"load_lora_weights": seconds}

    return run


def make_copy_floor(pipeline, adapters: list, verify: bool) -> Callable:
    """Copies into the parameters of the pipeline's resident "policy" adapter (the hotswap mode's)."""
    modules = dict(pipeline.transformer.named_modules())
    targets = {}
    for key in adapters[0]:
        module_name, rest = key.split(".lora_")
        layer = "lora_A" if rest.startswith("A.") else "lora_B"
        targets[key] = getattr(modules[module_name], layer)["policy"].weight

    def copy(tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, target in targets.items():
                target.copy_(tensors[key])

    def run(round_: harness.Round) -> dict:
        tensors = adapters[round_.index % 2]
        _, seconds = harness.timed_call(copy, tensors)
        if verify:
            check_pipeline(pipeline, "policy", tensors)
        return {"copy_": seconds}

    return run


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
    """Seconds of 1-step generate calls whose adapter differs from the previous call's ("switch")
    or not ("same"), pattern a a b b ... (a call sequence, not rounds of modes: the pattern is the
    measurement); and `activate` alone in the worker."""
    engine.load_lora("a", adapters[0], config)
    engine.load_lora("b", adapters[1], config)
    pattern = ("a", "a", "b", "b")
    warmup = len(pattern) * 2
    seconds: dict[str, list[float]] = {"same": [], "switch": [], "pair": []}  # pair: a switch minus the next call
    previous = None
    for index in range(warmup + args.switch_calls):
        lora = pattern[index % len(pattern)]
        params = SamplingParams(num_inference_steps=1, seed=index, lora=lora, return_trajectory=False)
        outputs, elapsed = harness.timed_call(engine.generate, [args.prompt], params)
        assert outputs[0].lora == lora
        if index >= warmup:
            switched = lora != previous
            seconds["switch" if switched else "same"].append(elapsed)
            if not switched and index > warmup:
                seconds["pair"].append(seconds["switch"][-1] - elapsed)
        previous = lora
    seconds["activate"] = engine.collective_rpc(_time_activate, args=(["a", "b"], args.activate_calls))[0]
    engine.unload_lora("a")
    engine.unload_lora("b")
    return {name: harness.Stats.of(values, 1e3) for name, values in seconds.items()}


# The breakdown: the engine's load_lora is a stage_lora RPC on every rank, then a commit_lora RPC.
# The step observer gives each RPC's seconds as the engine sees them, and worker timers
# (benchmarks.worker_timers) time the LoraManager pieces inside (they nest: stage holds the rest
# but commit; bound_modules runs in stage and again in commit's log line). A hot swap of the same
# layout copies into the live layers (_copies); _build runs only for a new layout.
_TIMED_PIECES = (
    ("LoraManager.stage", "loras.stage"),
    ("rollback (of a staged one)", "loras.rollback"),
    ("all_finite (NaN/inf check)", "rollout.lora:all_finite"),
    ("split_by_component (normalize_keys)", "rollout.lora:split_by_component"),
    ("_check_fits", "loras._check_fits"),
    ("_copies (same layout)", "loras._copies"),
    ("_build (new layers)", "loras._build"),
    ("bound_modules", "loras.bound_modules"),
    ("LoraManager.commit", "loras.commit"),
)
STAGE_RPC = "stage_lora rpc: transport (outside LoraManager.stage)"
COMMIT_RPC = "commit_lora rpc: transport (outside LoraManager.commit)"
ENGINE = "engine (outside the rpcs)"
BREAKDOWN_ROWS = (STAGE_RPC, *(name for name, _ in _TIMED_PIECES[:-1]), COMMIT_RPC, "LoraManager.commit", ENGINE)


def swap_breakdown(engine: RolloutEngine, adapters: list, config: dict, swaps: int) -> dict[str, float]:
    """Median ms per piece of a hot swap, and of its wall."""
    rpc_seconds: dict[str, list[float]] = {"stage_lora": [], "commit_lora": []}

    def observe(report: StepReport) -> None:
        if report.name in rpc_seconds:
            rpc_seconds[report.name].append(report.wall_s)

    engine.collective_rpc(install_timers, args=(_TIMED_PIECES,))
    stop_observing = engine.add_step_observer(observe)
    walls = []
    try:
        for index in range(swaps):
            _, seconds = harness.timed_call(engine.load_lora, "policy", adapters[index % 2], config)
            walls.append(seconds)
    finally:
        stop_observing()
        worker = engine.collective_rpc(remove_timers)[0]
    rpc = list(zip(rpc_seconds["stage_lora"], rpc_seconds["commit_lora"], strict=True))
    derived = {
        STAGE_RPC: [r - s for (r, _), s in zip(rpc, worker["LoraManager.stage"], strict=True)],
        COMMIT_RPC: [r - c for (_, r), c in zip(rpc, worker["LoraManager.commit"], strict=True)],
        ENGINE: [wall - stage - commit for wall, (stage, commit) in zip(walls, rpc, strict=True)],
    }
    pieces = {name: harness.Stats.of(values, 1e3).median for name, values in (worker | derived).items() if values}
    return pieces | {"wall": harness.Stats.of(walls, 1e3).median}


# Reporting.


def report_modes(report: harness.Report, samples: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """The operations' table and the hot-swap target; returns the numbers for the JSON."""
    summary = {}
    for mode, phases in samples.items():
        summary[mode] = {
            "ms": harness.Stats.of((sum(round_) for round_ in zip(*phases.values(), strict=True)), 1e3),
            "phases_median_ms": {phase: harness.Stats.of(values, 1e3).median for phase, values in phases.items()},
        }
    base, floor = summary[BASELINE]["ms"].median, summary["floor"]["ms"].median
    rows = []
    for mode in (mode for mode in MODES if mode in summary):
        ms = summary[mode]["ms"]
        summary[mode]["speedup_vs_diffusers"] = base / ms.median
        rows.append([MODE_LABELS[mode], ms.median, ms.min, ms.max, base / ms.median, ms.median / floor])
        if mode in TARGETED_MODES:
            report.check(harness.Target(f"{MODE_LABELS[mode]}: median ms", ms.median, "<", TARGET_SWAP_MS))
    report.table(
        f"LoRA operations (median of {len(summary[BASELINE]['ms'].values)} rounds)",
        ["operation", "median ms", "min ms", "max ms", "x faster", "x copy floor"],
        rows,
        note="x faster: diffusers load+delete median / this median; x copy floor: this median / the copy floor's",
    )
    split = [mode for mode in MODES if mode in summary and len(summary[mode]["phases_median_ms"]) > 1]
    report.table(
        "phases of the two-phase operations",
        ["operation", "phase", "median ms"],
        [[MODE_LABELS[m], phase, ms] for m in split for phase, ms in summary[m]["phases_median_ms"].items()],
    )
    return {mode: row | {"ms": row["ms"].to_json()} for mode, row in summary.items()}


def report_switching(report: harness.Report, switching: dict[str, harness.Stats]) -> dict:
    same, switch, pair, activate = (switching[name] for name in ("same", "switch", "pair", "activate"))
    report.table(
        "adapter switch on uni, 1-step generate (batch 1, CFG), pattern a a b b",
        ["measurement", "median ms", "min ms", "calls"],
        [
            ["same adapter as the previous call", same.median, same.min, len(same.values)],
            ["other adapter (set_adapters)", switch.median, switch.min, len(switch.values)],
            ["added by a switch (difference of the medians)", switch.median - same.median, "", ""],
            ["added, over adjacent pairs (switch call - next call)", pair.median, pair.min, len(pair.values)],
            ["LoraManager.activate a<->b alone", activate.median, activate.min, len(activate.values)],
        ],
    )
    return {name: stats.to_json() for name, stats in switching.items()} | {"added_ms": switch.median - same.median}


def report_breakdowns(report: harness.Report, breakdowns: dict[str, dict[str, float]], swaps: int) -> None:
    backends = list(breakdowns)
    pieces = [*BREAKDOWN_ROWS, "wall"]
    report.table(
        f"hot swap breakdown (median ms of {swaps} swaps)",
        ["piece", *(f"{backend} ms" for backend in backends)],
        [[piece, *(breakdowns[b].get(piece, "") for b in backends)] for piece in pieces],
        note="nested: LoraManager.stage holds the pieces below it up to bound_modules (which commit calls too);"
        " blank: not called",
    )


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from diffusers import StableDiffusion3Pipeline
    from diffusers.utils import logging as diffusers_logging
    from peft import LoraConfig

    diffusers_logging.set_verbosity_error()
    quiet_peft_warnings()
    verify = not args.no_verify
    report = harness.Report("lora_swap", args, __doc__, argv)
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
        report.note(
            f"adapter: rank {args.rank}, {adapter_info['modules']} modules, {adapter_info['parameters']:,} "
            f"parameters ({adapter_info['bytes'] / 1024:.0f} KiB float32); transformer: "
            f"{adapter_info['transformer_parameters']:,} parameters; verify {verify}"
        )
        engine_config = EngineConfig(model=str(model), executor="uni", max_batch_size=1)
        mp_config = EngineConfig(model=str(model), executor="mp", num_workers=1, max_batch_size=1)
        mp_engine = None if args.no_mp else RolloutEngine(mp_config)
        try:
            if mp_engine is not None:
                mp_engine.collective_rpc(quiet_peft_warnings)
            with RolloutEngine(engine_config) as engine:
                modes = {"swap_uni": make_engine_swap(engine, adapters, config, verify)}
                if mp_engine is not None:
                    modes["swap_mp"] = make_engine_swap(mp_engine, adapters, config, verify)
                modes["folder_swap_uni"] = make_engine_folder_swap(engine, peft_folders, adapters, verify)
                modes["folder_load_unload_uni"] = make_engine_folder_load_unload(
                    engine, peft_folders, adapters, verify
                )
                modes["diffusers"] = make_diffusers_load_delete(pipeline, diffusers_folders, adapters, verify)
                modes["diffusers_hotswap"] = make_diffusers_hotswap(pipeline, diffusers_folders, adapters, verify)
                modes["floor"] = make_copy_floor(pipeline, adapters, verify)
                print(f"modes: {', '.join(modes)}; {args.warmup} warmup + {args.repeats} rounds ...", flush=True)
                samples = harness.run_rounds(modes, args.warmup, args.repeats, quiet=True)
                engine.unload_lora("policy_from_folder")
                print("adapter switch test (uni) ...", flush=True)
                switching = measure_switching(engine, adapters, config, args)
                engines = [("uni", engine)] + ([("mp", mp_engine)] if mp_engine is not None else [])
                breakdowns = {
                    backend: swap_breakdown(target, adapters, config, args.breakdown_swaps)
                    for backend, target in (engines if args.breakdown_swaps else [])
                }
        finally:
            if mp_engine is not None:
                mp_engine.shutdown()
    report.results = {"adapter": adapter_info, "modes": report_modes(report, samples)}
    report.results["switching"] = report_switching(report, switching)
    if breakdowns:
        report_breakdowns(report, breakdowns, args.breakdown_swaps)
    report.results["breakdown_ms"] = breakdowns
    return report.finish()


if __name__ == "__main__":
    main()
