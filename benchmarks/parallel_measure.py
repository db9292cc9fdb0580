"""Parallel layouts measured on CPU processes: per-step time against one worker on the same threads, bytes sent.

`python -m benchmarks.parallel --mode measure`.

Each layout of `LAYOUTS` is a set of `EngineConfig` fields; it runs one replica on `mp` with the
same total threads (one worker x T threads against a group of R ranks x T/R threads), so what a
layout changes is how the same cores share one sample's work. Interleaved rounds time each
engine step (`StepReport.wall_s`, and its leader's seconds in the transformer); counters inside
the workers (`benchmarks.collective_bytes`) count the bytes every collective sends and the shape
of every forward, and the all-to-all bytes are checked against the cost model's formula
(`parallel_cost.ulysses_bytes_per_rank`) for the tokens and rows the forwards had.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness, model_presets
from benchmarks.collective_bytes import install_counters, remove_counters
from benchmarks.parallel_cost import ulysses_bytes_per_rank
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.families import family_named

# Layout name -> the EngineConfig fields that make it (one replica of their ranks). A layout of
# another kind of parallelism is one more line here: its degree's field below, too.
LAYOUTS = {
    "one worker": {},
    "Ulysses 2": {"sequence_parallel": 2},
    "CFG 2": {"cfg_parallel": 2},  # sends each step's velocity to its pair (one all_gather), no all-to-all
    # Not the same threads: tells what a layout gains from its ranks from what one process loses
    # to its threads (on a loaded machine a thread that waits for a core stalls its whole forward).
    "one worker, 1 thread": {"threads_per_worker": 1},
}
# The EngineConfig fields whose product is a layout's ranks per replica.
DEGREES = ("sequence_parallel", "cfg_parallel")
MEASURED_FAMILIES = ("flux", "wan")
MB = 1e6


def process_cpu_s(worker) -> float:
    """The worker process's CPU seconds so far (every thread's)."""
    return time.process_time()


def ranks_of(fields: dict) -> int:
    return math.prod(fields.get(name, 1) for name in DEGREES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--mode measure")
    group.add_argument("--family", choices=MEASURED_FAMILIES, default="flux", help="the model family measured")
    group.add_argument(
        "--preset", choices=("tiny", "small"), default="small", help="tiny: the test pipeline; small: CPU-bound"
    )
    group.add_argument("--total-threads", type=harness.positive_int, default=2, help="torch threads of each layout")
    group.add_argument("--measure-steps", type=harness.positive_int, default=6, help="denoising steps a round")
    group.add_argument("--samples", type=harness.positive_int, default=2, help="samples a round (one batch)")
    group.add_argument("--cfg", choices=("on", "off"), default="on", help="guidance: two passes a step, or one")
    group.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="leave out the layouts of other threads than --total-threads (one worker, 1 thread)",
    )


def _params(args: argparse.Namespace, seed: int) -> SamplingParams:
    family = family_named(args.family)
    video = args.family in model_presets.VIDEO_FAMILIES
    if args.preset == "tiny":
        height = width = 32
        frames = 9
    elif video:
        (height, width), frames = model_presets.DEFAULT_VIDEO_SIZE["small"], model_presets.DEFAULT_NUM_FRAMES["small"]
    else:
        height = width = model_presets.DEFAULT_SIZE["small"]
    fields = {"num_frames": frames} if video else {}
    return SamplingParams(
        num_inference_steps=args.measure_steps,
        num_samples=args.samples,
        seed=seed,
        height=height,
        width=width,
        sampler="flow_sde",
        **fields,
        **family.guidance_fields(args.cfg == "on"),
    )


def _build(args: argparse.Namespace, folder: Path) -> Path:
    family = family_named(args.family)
    if args.preset == "tiny":
        return family.build_tiny(folder, seed=0)
    return model_presets.build(args.family, args.preset, folder, "cpu", torch.float32)


def predicted_all_to_all_bytes(transformer_config: dict, family: str, forwards: list, ulysses: int) -> float:
    """The cost model's all-to-all bytes (one rank) for `forwards` (each (hidden_states shape,
    encoder_hidden_states shape)): 4·S·H·D·b·(u-1)/u² per attention layer per row, float32. FLUX.1:
    every layer's attention is joint, S image plus text tokens; Wan: its self-attentions over the
    video tokens, its cross-attention none (each rank keeps the text's K/V)."""
    heads, head_dim = transformer_config["num_attention_heads"], transformer_config["attention_head_dim"]
    total = 0.0
    for hidden, encoder in forwards:
        if family == "flux":
            layers = transformer_config["num_layers"] + transformer_config["num_single_layers"]
            tokens = hidden[1] + encoder[1]
        else:
            layers = transformer_config["num_layers"]
            tokens = math.prod(hidden[2:]) // math.prod(transformer_config["patch_size"])
        total += hidden[0] * layers * ulysses_bytes_per_rank(tokens, heads, head_dim, ulysses, 4)
    return total


def measure_mode(report: harness.Report, args: argparse.Namespace) -> None:
    layouts = {
        name: fields for name, fields in LAYOUTS.items() if "threads_per_worker" not in fields or args.reference
    }
    bad = [name for name, fields in layouts.items() if args.total_threads % ranks_of(fields)]
    if bad:
        raise SystemExit(f"--total-threads {args.total_threads} does not divide among the ranks of {bad}")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = _build(args, Path(tmp) / "pipeline")
        transformer_config = json.loads((Path(model) / "transformer" / "config.json").read_text())
        engines = {}
        for name, fields in layouts.items():
            ranks = ranks_of(fields)
            settings = {"threads_per_worker": args.total_threads // ranks} | fields
            config = EngineConfig(model=str(model), executor="mp", num_workers=ranks, **settings)
            if config.ranks_per_replica != ranks:
                raise SystemExit(
                    f"layout {name!r}: {fields} makes replicas of {config.ranks_per_replica} ranks, not {ranks}"
                )
            engines[name] = stack.enter_context(RolloutEngine(config))

        def mode(name: str):
            def run(round_: harness.Round) -> dict:
                engine = engines[name]
                cpu_before = engine.collective_rpc(process_cpu_s)
                with harness.step_reports(engine) as reports:
                    engine.generate(["a red square on a green field"], _params(args, round_.index))
                cpu = sum(engine.collective_rpc(process_cpu_s)) - sum(cpu_before)
                steps = [r for r in reports if r.kind == "step"]
                return {
                    "step_s": statistics.median(r.wall_s for r in steps),
                    "transformer_s": statistics.median(r.transformer_s[0] for r in steps),
                    "cpu_s": cpu / len(steps),  # every rank's, a step
                }

            return run

        samples = harness.run_rounds({name: mode(name) for name in layouts}, args.warmup, args.repeats)
        counted = {}
        for name, engine in engines.items():
            engine.collective_rpc(install_counters)
            engine.generate(["a red square on a green field"], _params(args, 0))
            counted[name] = engine.collective_rpc(remove_counters)
    _report(report, args, layouts, samples, counted, transformer_config)


def _report(report, args, layouts: dict, samples: dict, counted: dict, transformer_config: dict) -> None:
    base = statistics.median(samples["one worker"]["step_s"])
    rows, results = [], {}
    for name, fields in layouts.items():
        ranks = ranks_of(fields)
        threads = fields.get("threads_per_worker", args.total_threads // ranks)
        step = harness.Stats.of(samples[name]["step_s"], 1e3)
        transformer = harness.Stats.of(samples[name]["transformer_s"], 1e3)
        cpu = harness.Stats.of(samples[name]["cpu_s"], 1e3)
        per_rank = counted[name]
        steps = args.measure_steps
        # Bytes one rank sends a step, averaged over the group's ranks (an uneven split sends unevenly).
        sent = {
            collective: sum(c["collectives"].get(collective, {}).get("bytes", 0) for c in per_rank) / ranks / steps
            for collective in sorted({k for c in per_rank for k in c["collectives"]})
        }
        ulysses = fields.get("sequence_parallel", 1)
        forwards = per_rank[0]["forwards"]
        predicted = (
            predicted_all_to_all_bytes(transformer_config, args.family, forwards, ulysses) / steps
            if ulysses > 1
            else 0.0
        )
        all_to_all = sent.get("all_to_all_single", 0.0)
        others = sum(sent.values()) - all_to_all
        rows.append(
            [
                name,
                f"{ranks} x {threads}",
                step.median,
                f"{step.min:.4g}-{step.max:.4g}",
                step.median / (base * 1e3),
                transformer.median,
                cpu.median,
                all_to_all / MB,
                predicted / MB,
                all_to_all / predicted if predicted else "-",
                others / MB,
            ]
        )
        if predicted:
            report.check(harness.Target(f"{name} all-to-all bytes / cost model", all_to_all / predicted, "<=", 1.02))
            report.check(harness.Target(f"{name} cost model / all-to-all bytes", predicted / all_to_all, "<=", 1.02))
        results[name] = {
            "fields": fields,
            "ranks": ranks,
            "threads_per_rank": threads,
            "step_ms": step.to_json(),
            "transformer_ms": transformer.to_json(),
            "cpu_ms_all_ranks": cpu.to_json(),
            "sent_bytes_per_step_per_rank": sent,
            "cost_model_all_to_all_bytes_per_step": predicted,
            "forward_shapes": forwards[:1],
        }
    hidden, encoder = counted["one worker"][0]["forwards"][0]
    report.table(
        f"{args.family} ({args.preset}), {args.samples} samples, CFG {args.cfg}, {args.total_threads} threads per "
        f"layout: one engine step",
        [
            "layout",
            "ranks x threads",
            "step ms",
            "min-max",
            "vs one worker",
            "transformer ms",
            "CPU ms, all ranks",
            "all-to-all MB/step/rank",
            "cost model MB",
            "measured / model",
            "other collectives MB",
        ],
        rows,
        note=f"One forward's inputs: hidden_states {list(hidden)}, encoder_hidden_states "
        f"{list(encoder) if encoder else None}; float32. Step ms: the median engine step of each round "
        "(medians, min and max over rounds); transformer ms: the leader rank's seconds in the transformer's "
        "forwards a step; CPU ms: every rank's process CPU time a step (a thread waiting for a core it "
        "shares with other work spins, and counts here too). Bytes: what one rank's collectives send a "
        "step, counted inside the workers (an "
        "all-to-all: its input but the rows it keeps; a gather: its input to each other rank), averaged "
        "over the group's ranks. Other collectives: Ulysses' output gather at `proj_out` and the all-gathers "
        "of split sizes diffusers' Ulysses-anything mode makes; CFG's exchange of each step's velocity "
        "(and of a flag that both passes ran).",
    )
    report.note(
        "Where the cores run other work too, a wall time measures a layout's share of the cores as much as its "
        "work: a process of two threads stalls whenever one of them waits for a core, which is why 'one worker, "
        "1 thread' is beside the layouts of the same threads; CPU ms is what each layout asks of the cores."
    )
    report.results["measure"] = results
