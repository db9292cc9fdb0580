"""LoRA swap: milliseconds to replace, switch and load a LoRA adapter, engine vs. plain diffusers.

Builds the tiny SD3 pipeline (random weights) and two random rank-`--rank` PEFT adapters on the
attention projections (`init_lora_weights=False`: every swap changes the outputs), each also saved
as a PEFT folder and as a diffusers LoRA folder, and measures one operation each:

  swap uni / swap mp      `engine.load_lora("policy", tensors, config)` while "policy" is loaded: the
                          trainer's per-step push (a hot swap), executor "uni" and "mp" (1 worker);
  folder swap uni         `engine.load_lora("policy", peft_folder)`: the same, read by the worker;
  folder load+unload uni  `engine.load_lora("fresh", peft_folder)`, then `engine.unload_lora("fresh")`;
  diffusers load+delete   `pipeline.load_lora_weights(folder, adapter_name="fresh")`, then
                          `pipeline.delete_adapters("fresh")`: the baseline, without the engine;
  diffusers hotswap       `pipeline.load_lora_weights(folder, adapter_name="policy", hotswap=True)`
                          (reference, no target);
  copy floor              `param.copy_(tensor)` of every LoRA tensor into a resident adapter: what any
                          hot swap must at least spend.

Rounds alternate the two adapters; after each operation (untimed) the weights held are compared
bitwise with those sent. Then, on "uni" with adapters "a" and "b" resident, 1-step generate calls
in the pattern a a b b ... measure what a switch (`set_adapters`) adds, and `LoraManager.activate`
is timed alone. Last, the step observer and worker timers split a hot swap into its pieces (RPCs,
NaN/inf check, key checks, copies into the live layers). Target: a hot swap (uni, mp) under 50 ms.

    python -m benchmarks.lora_swap                     # rank 32, 2 warmup + 50 rounds
    python -m benchmarks.lora_swap --repeats 20 --no-mp --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
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

# Attention projections of SD3Transformer2DModel's joint blocks (the last has no `to_add_out`).
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
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
TARGET_SWAP_MS = 50.0
TARGETED_MODES = ("swap_uni", "swap_mp")


def build_parser() -> argparse.ArgumentParser:
    parser = harness.parser("lora_swap", __doc__, repeats=50, warmup=2)
    run = parser.add_argument_group("what to run")
    run.add_argument("--rank", type=harness.positive_int, default=32, help="LoRA rank r (lora_alpha = r)")
    run.add_argument("--switch-calls", type=harness.positive_int, default=200, help="timed 1-step generate calls")
    run.add_argument("--activate-calls", type=harness.positive_int, default=200, help="LoraManager.activate calls")
    run.add_argument("--breakdown-swaps", type=harness.count, default=20, help="hot swaps split in pieces (0: skip)")
    run.add_argument("--no-mp", action="store_true", help="skip the mp engine (no worker process)")
    run.add_argument("--no-verify", action="store_true", help="do not compare the held weights after each operation")
    run.add_argument("--prompt", default="a red cube on a blue table", help="prompt of the adapter-switch test")
    return parser


def quiet_peft_warnings(worker=None) -> None:
    """Silence PEFT's warnings on every delete of the active adapter and on every second adapter (here,
    every operation), in this process or, through `collective_rpc`, in a worker."""
    for message in ("Adapter .* was active which is now deleted", "Already found a `peft_config` attribute"):
        warnings.filterwarnings("ignore", message=message)


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


def save_folders(root: Path, adapters: list, config) -> tuple[list[str], list[str]]:
    """Each adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors with keys
    `base_model.model.*`) and as a diffusers folder (pytorch_lora_weights.safetensors, keys `transformer.*`)."""
    from safetensors.torch import save_file

    peft, lora = [], []
    for index, adapter in enumerate(adapters):
        tensors = {key: tensor.contiguous() for key, tensor in adapter.items()}
        peft.append(root / f"peft{index}")
        lora.append(root / f"diffusers{index}")
        lora[-1].mkdir(parents=True)
        config.save_pretrained(str(peft[-1]))  # makes the folder
        save_file({f"base_model.model.{k}": t for k, t in tensors.items()}, peft[-1] / "adapter_model.safetensors")
        save_file({f"transformer.{k}": t for k, t in tensors.items()}, lora[-1] / "pytorch_lora_weights.safetensors")
    return [str(folder) for folder in peft], [str(folder) for folder in lora]


# Checks, run in the worker (any executor) or on the baseline pipeline; never timed.


def _holds(transformer, layers: str, expected: dict[str, torch.Tensor]) -> bool:
    """Whether the PEFT adapter `layers` of `transformer` holds `expected`."""
    from peft.utils import get_peft_model_state_dict

    held = get_peft_model_state_dict(transformer, adapter_name=layers)
    return held.keys() == expected.keys() and all(torch.equal(held[k], expected[k]) for k in expected)


def _worker_holds(worker, name: str, expected: dict[str, torch.Tensor]) -> bool:
    # The worker's LoraManager builds an adapter's layers under a PEFT name of their own.
    return _holds(worker.adapter.transformer, worker.loras._layers[name], expected)


def phased(holds: Callable[[int], bool], **phases: Callable[[int], object]) -> Callable:
    """A mode for `harness.run_rounds`: round r runs each phase on adapter r % 2, timed, and checks
    `holds(r % 2)` after the first, untimed; it returns {phase: seconds} (the operation is their sum)."""

    def run(round_: harness.Round) -> dict[str, float]:
        which, seconds = round_.index % 2, {}
        for name, phase in phases.items():
            _, seconds[name] = harness.timed_call(phase, which)
            if len(seconds) == 1 and not holds(which):
                raise AssertionError(f"{name}: the adapter does not hold the tensors just loaded")
        return seconds

    return run


def copy_floor(pipeline, adapters: list) -> Callable[[int], None]:
    """Copies adapter i into the parameters of the pipeline's resident "policy" adapter."""
    modules = dict(pipeline.transformer.named_modules())
    targets = {}
    for key in adapters[0]:
        module_name, rest = key.split(".lora_")
        layer = "lora_A" if rest.startswith("A.") else "lora_B"
        targets[key] = getattr(modules[module_name], layer)["policy"].weight

    @torch.no_grad()
    def copy(which: int) -> None:
        for key, target in targets.items():
            target.copy_(adapters[which][key])

    return copy


def make_modes(engines: dict, pipeline, adapters: list, config: dict, peft: list, lora: list, verify: bool) -> dict:
    """The modes, in MODE_LABELS' order, on `engines` ({"uni": engine, "mp": engine}) and `pipeline`, from
    `peft` and diffusers (`lora`) folders; a mode that swaps into a resident adapter loads adapter 1 first."""

    def on_engine(engine: RolloutEngine, name: str):
        return lambda which: not verify or all(engine.collective_rpc(_worker_holds, args=(name, adapters[which])))

    def on_pipeline(name: str):
        return lambda which: not verify or _holds(pipeline.transformer, name, adapters[which])

    def swap_into(engine: RolloutEngine):
        return lambda which: engine.load_lora("policy", adapters[which], config)

    uni, modes = engines["uni"], {}
    for backend, engine in engines.items():
        engine.load_lora("policy", adapters[1], config)
        modes[f"swap_{backend}"] = phased(on_engine(engine, "policy"), load_lora=swap_into(engine))
    uni.load_lora("policy_from_folder", peft[1])
    modes["folder_swap_uni"] = phased(
        on_engine(uni, "policy_from_folder"), load_lora=lambda which: uni.load_lora("policy_from_folder", peft[which])
    )
    modes["folder_load_unload_uni"] = phased(
        on_engine(uni, "fresh"),
        load_lora=lambda which: uni.load_lora("fresh", peft[which]),
        unload_lora=lambda which: uni.unload_lora("fresh"),
    )
    modes["diffusers"] = phased(
        on_pipeline("fresh"),
        load_lora_weights=lambda which: pipeline.load_lora_weights(lora[which], adapter_name="fresh"),
        delete_adapters=lambda which: pipeline.delete_adapters("fresh"),
    )
    pipeline.load_lora_weights(lora[1], adapter_name="policy")
    modes["diffusers_hotswap"] = phased(
        on_pipeline("policy"),
        load_lora_weights=lambda which: pipeline.load_lora_weights(lora[which], adapter_name="policy", hotswap=True),
    )
    modes["floor"] = phased(on_pipeline("policy"), copy_=copy_floor(pipeline, adapters))
    return modes


def _time_activate(worker, names: list[str], calls: int) -> list[float]:
    """Seconds of each `LoraManager.activate` call, alternating between `names` (every call a switch)."""
    seconds = []
    for index in range(calls):
        start = time.perf_counter()
        worker.loras.activate(names[index % len(names)], 1.0)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure_switching(engine: RolloutEngine, adapters: list, config: dict, args: argparse.Namespace) -> dict:
    """Seconds of 1-step generate calls whose adapter differs from the previous call's ("switch") or not
    ("same"), in the pattern a a b b ... (not rounds: the pattern is the measurement); and `activate` alone."""
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


# The breakdown: load_lora is a stage_lora RPC on every rank, then a commit_lora RPC, timed by the step
# observer; worker timers time the LoraManager pieces inside (stage holds all but commit; bound_modules
# runs in stage and again in commit). A same-layout hot swap copies (_copies); _build is for a new layout.
_TIMED_PIECES = (
    ("LoraManager.stage", "loras.stage"),
    ("rollback (of a staged one)", "loras.rollback"),
    ("all_finite (NaN/inf check)", "rollout.lora.manager:all_finite"),
    ("split_by_component (normalize_keys)", "rollout.lora.manager:split_by_component"),
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
    engine.collective_rpc(install_timers, args=(_TIMED_PIECES,))
    try:
        with harness.step_reports(engine) as reports:
            walls = [harness.timed_call(engine.load_lora, "policy", adapters[i % 2], config)[1] for i in range(swaps)]
    finally:
        worker = engine.collective_rpc(remove_timers)[0]
    rpc_seconds = {name: [r.wall_s for r in reports if r.name == name] for name in ("stage_lora", "commit_lora")}
    rpc = list(zip(rpc_seconds["stage_lora"], rpc_seconds["commit_lora"], strict=True))
    derived = {
        STAGE_RPC: [r - s for (r, _), s in zip(rpc, worker["LoraManager.stage"], strict=True)],
        COMMIT_RPC: [r - c for (_, r), c in zip(rpc, worker["LoraManager.commit"], strict=True)],
        ENGINE: [wall - stage - commit for wall, (stage, commit) in zip(walls, rpc, strict=True)],
    }
    pieces = {name: harness.Stats.of(values, 1e3).median for name, values in (worker | derived).items() if values}
    return pieces | {"wall": harness.Stats.of(walls, 1e3).median}


def report_modes(report: harness.Report, samples: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """The operations' table and the hot-swap target; returns the numbers for the JSON."""
    ms = {mode: harness.Stats.of(map(sum, zip(*p.values(), strict=True)), 1e3) for mode, p in samples.items()}
    base, floor = ms[BASELINE].median, ms["floor"].median
    report.table(
        f"LoRA operations (median of {len(ms[BASELINE].values)} rounds)",
        ["operation", "median ms", "min ms", "max ms", "x faster", "x copy floor"],
        [[MODE_LABELS[mode], s.median, s.min, s.max, base / s.median, s.median / floor] for mode, s in ms.items()],
        note="x faster: diffusers load+delete median / this median; x copy floor: this median / the copy floor's",
    )
    for mode in (mode for mode in TARGETED_MODES if mode in ms):
        report.check(harness.Target(f"{MODE_LABELS[mode]}: median ms", ms[mode].median, "<", TARGET_SWAP_MS))
    phases = {mode: {phase: harness.Stats.of(v, 1e3).median for phase, v in p.items()} for mode, p in samples.items()}
    report.table(
        "phases of the two-phase operations",
        ["operation", "phase", "median ms"],
        [[MODE_LABELS[mode], phase, t] for mode, p in phases.items() if len(p) > 1 for phase, t in p.items()],
    )
    return {
        mode: {"ms": s.to_json(), "phases_median_ms": phases[mode], "speedup_vs_diffusers": base / s.median}
        for mode, s in ms.items()
    }


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
        model = str(build_tiny_sd3(Path(tmp) / "model", seed=0))
        pipeline = StableDiffusion3Pipeline.from_pretrained(
            model, text_encoder_3=None, tokenizer_3=None, local_files_only=True
        )
        pipeline.set_progress_bar_config(disable=True)
        config = {"r": args.rank, "lora_alpha": args.rank, "target_modules": LORA_TARGETS}
        peft_config = LoraConfig(**config, init_lora_weights=False)
        adapters = make_adapters(pipeline.transformer, peft_config)
        peft, lora = save_folders(Path(tmp), adapters, peft_config)
        tensors = adapters[0].values()
        adapter_info = {
            "rank": args.rank,
            "modules": len({key.split(".lora_")[0] for key in adapters[0]}),
            "parameters": sum(t.numel() for t in tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "transformer_parameters": sum(p.numel() for p in pipeline.transformer.parameters()),
        }
        report.note(
            f"adapter: rank {args.rank}, {adapter_info['modules']} modules, {adapter_info['parameters']:,} "
            f"parameters ({adapter_info['bytes'] / 1024:.0f} KiB float32); transformer: "
            f"{adapter_info['transformer_parameters']:,} parameters; verify {verify}"
        )
        with contextlib.ExitStack() as stack:
            engines = {}
            for executor in ["uni"] + ([] if args.no_mp else ["mp"]):
                engine_config = EngineConfig(model=model, executor=executor, max_batch_size=1)
                engines[executor] = stack.enter_context(RolloutEngine(engine_config))
                engines[executor].collective_rpc(quiet_peft_warnings)
            modes = make_modes(engines, pipeline, adapters, config, peft, lora, verify)
            print(f"modes: {', '.join(modes)}; {args.warmup} warmup + {args.repeats} rounds ...", flush=True)
            samples = harness.run_rounds(modes, args.warmup, args.repeats, quiet=True)
            engines["uni"].unload_lora("policy_from_folder")
            print("adapter switch test (uni) ...", flush=True)
            switching = measure_switching(engines["uni"], adapters, config, args)
            breakdowns = {
                backend: swap_breakdown(engine, adapters, config, args.breakdown_swaps)
                for backend, engine in (engines.items() if args.breakdown_swaps else [])
            }
    report.results = {"adapter": adapter_info, "modes": report_modes(report, samples)}
    report.results["switching"] = report_switching(report, switching)
    if breakdowns:
        report.table(
            f"hot swap breakdown (median ms of {args.breakdown_swaps} swaps)",
            ["piece", *(f"{backend} ms" for backend in breakdowns)],
            [[piece, *(b.get(piece, "") for b in breakdowns.values())] for piece in [*BREAKDOWN_ROWS, "wall"]],
            note="nested: LoraManager.stage holds the pieces below it up to bound_modules (which commit calls too);"
            " blank: not called",
        )
    report.results["breakdown_ms"] = breakdowns
    return report.finish()


if __name__ == "__main__":
    main()
