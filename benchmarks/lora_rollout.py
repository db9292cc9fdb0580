"""LoRA rollouts: a rollout with the policy adapter merged vs. unmerged vs. the base model alone.

Builds a pipeline of the chosen family (SD3 or FLUX.1; random weights, see benchmarks/model_presets.py)
in a temporary folder, loads one random rank-r adapter per `--ranks` on the family's default LoRA
targets into one engine of one worker (`--executor`: "uni" runs it in this process, "mp" in a worker
process, where a step reaches it through the RPC dispatch real runs use), and measures, at the same
batch, steps, size and guidance:

  base          `engine.generate` without an adapter: the LoRA layers off and bypassed
                (`rollout.lora.bypass`), so it runs the model as it is without adapters;
  base again    the same once more: its ratio to the base is the noise floor of the ratios (the
                two are one mode measured twice, in the same rounds);
  merged rR     with the rank-R adapter merged into the base weights (`merge_lora`), the time of
                one merge included (each run starts from the base: as a rollout after a push does;
                the worker's merge count checks that it merges once, not once per step);
  unmerged rR   with the rank-R adapter as PEFT runs it: two low-rank matmuls added per targeted layer.

With --compile blocks every mode runs compiled transformer blocks (`EngineConfig.compile`): what an
unmerged adapter costs once compiling has fused its low-rank matmuls into the blocks' graphs (the
price of re-scoring exactly in bfloat16, where "auto" leaves adapters unmerged).

Every mode runs once per round, in the harness's interleaved order, after the same warm-up
rounds; `--threads` is 1 by default: more torch threads than idle cores make each op wait for
descheduled threads, and the ratios then wander by more than the 2% they are held to.

Then, on the engine's own transformer, the milliseconds of one merge and one restore per rank, and
with --merge-at-real-size the same on a real-size transformer built on this machine without the
rest of its pipeline (weights allocated, not initialised: the timing does not depend on values), for
a CPU without the memory or the speed to run the real model. Target: merged within 2% of the base.

    python -m benchmarks.lora_rollout                              # SD3, CPU-sized, ranks 8 and 64
    python -m benchmarks.lora_rollout --executor mp                # the same, the worker in a process
    python -m benchmarks.lora_rollout --compile blocks             # every mode with compiled blocks
    python -m benchmarks.lora_rollout --family flux --cfg off                 # FLUX.1-dev's distilled guidance
    python -m benchmarks.lora_rollout --family sd3 --merge-at-real-size sd35_medium   # + a real-size merge
    python -m benchmarks.lora_rollout --family sd3 --preset real --device cuda --dtype bfloat16 --ranks 32 64
    python -m benchmarks.lora_rollout --family flux --cfg off --preset real --device cuda --dtype bfloat16 \\
        --ranks 32 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks import harness, model_presets
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.config import COMPILE_CHOICES
from rollout.lora.merge import MergedLora, pristine_bytes
from rollout.pipelines.families import family_named
from rollout.pipelines.loading import adapter_class

FAMILIES = ("sd3", "flux")
EXECUTORS = ("uni", "mp")
TARGET_MERGED_VS_BASE = 1.02
DEFAULTS = {  # preset -> (batch, steps)
    "small": (8, 6),
    "real": (8, 10),
}
MERGE_REPEATS = 3
# Real-size transformers for --merge-at-real-size: (family, diffusers class, config).
REAL_TRANSFORMERS = {
    "sd35_medium": ("sd3", "SD3Transformer2DModel", model_presets.SD35_MEDIUM),
    "flux1_dev": ("flux", "FluxTransformer2DModel", model_presets.FLUX1_DEV),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(
        "lora_rollout", __doc__, repeats=5, warmup=1, threads=1, device="cpu", dtype="float32", model_folder=None
    )
    parser.add_argument("--family", choices=FAMILIES, default="sd3", help="the pipeline family")
    parser.add_argument(
        "--executor", choices=EXECUTORS, default="uni", help="where the one worker runs: this process or its own"
    )
    parser.add_argument("--preset", choices=model_presets.PRESETS, default="small", help="small: CPU; real: GPU")
    parser.add_argument("--ranks", type=harness.positive_int, nargs="+", default=[8, 64], help="LoRA ranks r")
    parser.add_argument("--batch-size", type=harness.positive_int, help="images per call (8)")
    parser.add_argument("--steps", type=harness.positive_int, help="denoising steps (6 small, 10 real)")
    parser.add_argument("--size", type=int, help="height and width (default 64 small, 512 real)")
    parser.add_argument("--cfg", choices=("on", "off"), default="on", help="guidance as the family's cfg_on / cfg_off")
    parser.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="off",
        help="the engine's compile setting: 'blocks' runs every mode with compiled transformer blocks (the "
        "warm-up rounds pay the compiles; each unmerged adapter compiles its own graphs)",
    )
    parser.add_argument(
        "--merge-at-real-size",
        choices=("none", *REAL_TRANSFORMERS),
        default="none",
        help="also time a merge + restore on this real-size transformer, built here in --merge-dtype",
    )
    parser.add_argument("--merge-dtype", choices=("float32", "bfloat16"), default="bfloat16", help="its dtype")
    parser.add_argument("--merge-rank", type=harness.positive_int, default=64, help="its adapter's rank")
    args = parser.parse_args(argv)
    batch, steps = DEFAULTS[args.preset]
    args.batch_size = args.batch_size or batch
    args.steps = args.steps or steps
    args.size = args.size or model_presets.DEFAULT_SIZE[args.preset]
    return args


def linear_shapes(worker, targets: list[str]) -> dict[str, tuple[int, int]]:
    """(out, in) of every `nn.Linear` of the worker's transformer that `targets` names (PEFT's rule)."""
    from peft import LoraConfig

    from rollout.lora.manager import _is_target

    config = LoraConfig(target_modules=targets)
    return {
        name: (module.out_features, module.in_features)
        for name, module in worker.adapter.transformer.named_modules()
        if isinstance(module, nn.Linear) and _is_target(config, name)
    }


def random_adapter(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """PEFT LoRA tensors of rank `rank` for the modules of `shapes`, small enough to keep images sane."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (out_features, in_features) in shapes.items():
        tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01 / rank**0.5
    return tensors


def worker_state(engine: RolloutEngine) -> dict:
    """The worker's read-only `hot_swap_state`: any other function gets the base weights back
    before it runs (`rollout.worker.worker.call_function`), so it would always find nothing merged."""
    (state,) = engine.collective_rpc("hot_swap_state")
    return state


def worker_cpu_seconds(engine: RolloutEngine) -> float:
    """The CPU seconds so far of the worker's process (this one on "uni"). A worker function: it
    restores a merged adapter before it runs."""
    (seconds,) = engine.collective_rpc(lambda worker: time.process_time())
    return seconds


def make_run(engine: RolloutEngine, args: argparse.Namespace, reports: list, lora: str | None, merge: bool):
    """One mode: a generate call's wall seconds ("s"), its seconds in transformer forwards
    ("transformer_s", from the engine's StepReports: a merge is outside them), and the CPU seconds
    the worker's process spent in it ("cpu_s": what a loaded machine's other processes take is in
    the wall seconds, not in these)."""
    guidance = family_named(args.family).guidance_fields(args.cfg == "on")

    def set_merge(worker) -> None:
        worker.loras.set_merge(merge)

    def run(round_: harness.Round) -> dict[str, float]:
        engine.collective_rpc(set_merge)  # from the base weights, as a rollout right after a push
        params = SamplingParams(
            sampler="flow_sde",
            num_inference_steps=args.steps,
            height=args.size,
            width=args.size,
            num_samples=args.batch_size,
            seed=round_.index,
            lora=lora,
            **guidance,
        )
        reports.clear()
        merges, cpu_start = worker_state(engine)["merges"], worker_cpu_seconds(engine)
        _, seconds = harness.timed_call(engine.generate, ["a red cube on a blue table"], params, device=args.device)
        state = worker_state(engine)  # before anything restores the merge
        cpu_seconds = worker_cpu_seconds(engine) - cpu_start
        forwards = sum(sum(report.transformer_s) for report in reports if report.kind == "step")
        merged = merge and lora is not None
        assert state["merged_lora"] == ((lora, 1.0) if merged else None), state["merged_lora"]
        # One merge for the whole rollout, on every executor (a step never restores the base).
        assert state["merges"] - merges == int(merged), f"{state['merges'] - merges} merges in one rollout"
        return {"s": seconds, "transformer_s": forwards, "cpu_s": cpu_seconds}

    return run


def time_merge(merge_once, restore, device: str, repeats: int) -> dict[str, float]:
    """Median milliseconds of `merge_once()` and of `restore()` over `repeats` cycles."""
    merges, restores = [], []
    for _ in range(repeats):
        harness.synchronize(device)
        start = time.perf_counter()
        merge_once()
        harness.synchronize(device)
        middle = time.perf_counter()
        restore()
        harness.synchronize(device)
        merges.append(middle - start)
        restores.append(time.perf_counter() - middle)
    return {"merge_ms": 1e3 * statistics.median(merges), "restore_ms": 1e3 * statistics.median(restores)}


def engine_merge_times(engine: RolloutEngine, ranks: list[int], device: str) -> dict[int, dict[str, float]]:
    """Per rank: one `activate` that merges (from the base) and one `restore`, on the worker."""

    def measure(worker, name: str) -> dict[str, float]:
        loras = worker.loras
        loras.set_merge(True)
        loras.activate(None, 1.0)
        times = time_merge(lambda: loras.activate(name, 1.0), loras.restore, device, MERGE_REPEATS)
        layers = loras._layers[name]
        return times | {"merged_bytes": pristine_bytes(worker.adapter.transformer, layers)}

    return {rank: engine.collective_rpc(lambda worker, r=rank: measure(worker, f"r{r}"))[0] for rank in ranks}


def real_size_merge(name: str, dtype: torch.dtype, rank: int, device: str) -> dict:
    """One merge + restore of a rank-`rank` adapter on the family's default targets of real-size
    transformer `name`, built on `device` with its weights allocated but not initialised (zeroed:
    no denormals to slow the arithmetic)."""
    import diffusers
    from peft import LoraConfig

    from rollout.lora.manager import adapter_to_float32

    family, class_name, config = REAL_TRANSFORMERS[name]
    with torch.device("meta"):
        transformer = getattr(diffusers, class_name)(**config).to(dtype)
    transformer = transformer.to_empty(device=device)
    with torch.no_grad():
        for tensor in [*transformer.parameters(), *transformer.buffers()]:
            tensor.zero_()
    targets = list(adapter_class(family_named(family).pipeline_class).default_lora_targets)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False))
    adapter_to_float32(transformer, "default")
    transformer.disable_lora()
    held: list[MergedLora] = []
    times = time_merge(
        lambda: held.append(MergedLora(transformer, "default", 1.0)),
        lambda: held.pop().restore(),
        device,
        MERGE_REPEATS,
    )
    return times | {
        "parameters": sum(p.numel() for n, p in transformer.named_parameters() if ".lora_" not in n),
        "merged_bytes": pristine_bytes(transformer, "default"),
        "rank": rank,
        "dtype": str(dtype).removeprefix("torch."),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # a uni worker runs in this process (the header records it)
    report = harness.Report("lora_rollout", args, __doc__, argv)
    load = os.getloadavg()[0]
    report.note(
        f"family {args.family}, executor {args.executor}, preset {args.preset}, dtype {args.dtype}, batch "
        f"{args.batch_size}, steps {args.steps}, {args.size}x{args.size}, CFG {args.cfg}, flow_sde, compile "
        f"{args.compile}; "
        f"{args.threads} threads; rounds {args.warmup} warmup + {args.repeats} timed"
    )
    try:
        measure(args, report)
    finally:
        torch.set_num_threads(previous_threads)
    report.note(f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    return report.finish()


def measure(args: argparse.Namespace, report: harness.Report) -> None:
    """Build the pipeline, run the rounds and the merges, and fill `report`'s tables, targets and results."""
    dtype = getattr(torch, args.dtype)
    with model_presets.built(args.family, args.preset, args.device, dtype, args.model_folder) as folder:
        class_name = json.loads((Path(folder) / "model_index.json").read_text())["_class_name"]
        targets = list(adapter_class(class_name).default_lora_targets)
        config = EngineConfig(
            model=folder,
            executor=args.executor,
            threads_per_worker=args.threads if args.executor == "mp" else None,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.batch_size,
            merge_lora="always",
            compile=args.compile,
        )
        with RolloutEngine(config) as engine:
            (shapes,) = engine.collective_rpc(lambda worker: linear_shapes(worker, targets))
            (parameters,) = engine.collective_rpc(
                lambda worker: sum(
                    p.numel() for n, p in worker.adapter.transformer.named_parameters() if ".lora_" not in n
                )
            )
            report.note(
                f"{class_name}: transformer {parameters / 1e6:.1f}M parameters; adapters on {len(shapes)} "
                f"modules ({', '.join(targets)})"
            )
            for rank in args.ranks:
                lora_config = {"r": rank, "lora_alpha": rank, "target_modules": targets}
                engine.load_lora(f"r{rank}", random_adapter(shapes, rank, seed=rank), lora_config)
            with harness.step_reports(engine) as reports:
                modes = {
                    "base": make_run(engine, args, reports, None, merge=True),
                    "base again": make_run(engine, args, reports, None, merge=True),
                }
                for rank in args.ranks:
                    modes[f"merged r{rank}"] = make_run(engine, args, reports, f"r{rank}", merge=True)
                    modes[f"unmerged r{rank}"] = make_run(engine, args, reports, f"r{rank}", merge=False)
                samples = harness.run_rounds(modes, args.warmup, args.repeats)
            merges = engine_merge_times(engine, args.ranks, args.device)
    rows, results = [], {}
    for mode in modes:
        wall, forwards = samples[mode]["s"], samples[mode]["transformer_s"]
        stats = harness.Stats.of(wall)
        ratio = harness.per_round_ratio(wall, samples["base"]["s"])
        forward_ratio = harness.per_round_ratio(forwards, samples["base"]["transformer_s"])
        cpu = samples[mode]["cpu_s"]
        cpu_ratio = harness.per_round_ratio(cpu, samples["base"]["cpu_s"])
        rows.append(
            [
                *(mode, stats.median, stats.min, stats.max, ratio),
                *(harness.Stats.of(forwards).median, forward_ratio, harness.Stats.of(cpu).median, cpu_ratio),
            ]
        )
        results[mode] = {
            "s": stats.to_json(),
            "transformer_s": harness.Stats.of(forwards).to_json(),
            "cpu_s": harness.Stats.of(cpu).to_json(),
            "vs_base": ratio,
            "transformer_vs_base": forward_ratio,
            "cpu_vs_base": cpu_ratio,
        }
    report.table(
        "rollout time (one generate call)",
        ["mode", "median s", "min s", "max s", "time / base", "forwards s", "forwards / base", "cpu s", "cpu / base"],
        rows,
        note="/ base: the median of the rounds' ratios; base again / base is their noise floor; merged runs "
        "include their one merge, which the forwards' seconds (the transformer calls alone) leave out; cpu: "
        "the worker's process's CPU seconds, which other processes on a loaded machine do not add to",
    )
    for rank in args.ranks:
        ratio = results[f"merged r{rank}"]["vs_base"]
        report.check(harness.Target(f"merged r{rank} time / base time", ratio, "<=", TARGET_MERGED_VS_BASE))
        if args.device == "cpu":  # on a GPU the host's CPU seconds are not the rollout's cost
            ratio = results[f"merged r{rank}"]["cpu_vs_base"]
            report.check(harness.Target(f"merged r{rank} CPU time / base", ratio, "<=", TARGET_MERGED_VS_BASE))
    report.table(
        "merge + restore on the engine's transformer (median ms)",
        ["rank", "merge ms", "restore ms", "merged weights MiB"],
        [[rank, m["merge_ms"], m["restore_ms"], m["merged_bytes"] / 2**20] for rank, m in merges.items()],
        note="merged weights: the extra memory while merged (the base stays aside, untouched)",
    )
    report.results = {"modes": results, "merge": merges, "pipeline_class": class_name, "parameters": parameters}
    if args.merge_at_real_size != "none":
        print(f"merge + restore on {args.merge_at_real_size} ({args.merge_dtype}) ...", flush=True)
        real = real_size_merge(args.merge_at_real_size, getattr(torch, args.merge_dtype), args.merge_rank, args.device)
        report.table(
            f"merge + restore at real size: {args.merge_at_real_size} transformer (median ms of {MERGE_REPEATS})",
            ["parameters", "dtype", "rank", "merge ms", "restore ms", "merged weights MiB"],
            [
                [
                    real["parameters"],
                    real["dtype"],
                    real["rank"],
                    real["merge_ms"],
                    real["restore_ms"],
                    real["merged_bytes"] / 2**20,
                ]
            ],
        )
        report.results["real_size_merge"] = real


if __name__ == "__main__":
    main()
