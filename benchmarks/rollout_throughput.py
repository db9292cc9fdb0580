"""Rollout throughput: the engine vs. the family's diffusers pipeline vs. the transformer forwards alone.

Builds a pipeline of the chosen family (SD3, FLUX.1, Qwen-Image, Wan 2.1 or Wan 2.2 with its two
experts; random weights, see benchmarks/model_presets.py) in a temporary folder and measures, at the
same batch size, steps, image size (and frames) and guidance:

  engine     `RolloutEngine` (executor "uni"), sampler flow_sde, trajectories recorded, images (videos)
             decoded;
  diffusers  the family's diffusers pipeline from the same folder, ODE sampling, output_type="np";
  floor      the same number of transformer calls on the same input shapes (2 x batch with CFG),
             embeddings precomputed, under torch.no_grad: what any sampler must at least spend
             (Wan 2.2: each step on the expert the real schedule gives it).

Video families report frames/s (videos/s x frames). On CUDA the table adds each mode's
memory peak above what was allocated when its call began (both copies of the weights, the engine's
and the diffusers pipeline's, stay allocated throughout and are printed once).

The three are interleaved (each round runs all three, in a rotated order) so machine noise hits all
alike; warmup rounds are discarded and the median of the timed rounds is reported. All three run on
the engine's worker thread (diffusers and the floor through `collective_rpc`): glibc gives each
thread its own malloc arena, and large activations page-faulted anew on one thread but reused on
another moved the ratios by up to 15% either way. Afterwards one
more engine run with timers on the worker's pieces shows where the engine spends its time beyond
the floor. With --peak-tflops the report adds the transformer's model-FLOPs utilisation (FLOPs of
each step's forwards, counted by torch's FLOP counter).

    python -m benchmarks.rollout_throughput --family flux           # CPU-sized model, batch 16, 10 steps
    python -m benchmarks.rollout_throughput --family sd3 --preset real --device cuda --dtype bfloat16 \\
        --peak-tflops 989                                            # SD3.5 Medium's transformer on an H200
    python -m benchmarks.rollout_throughput --family wan            # CPU-sized Wan 2.1: batch 16, 9 frames of 32x32
    python -m benchmarks.rollout_throughput --family wan --preset real --device cuda --dtype bfloat16
                                                                     # Wan 2.1 1.3B: batch 1, 33 frames of 480x832
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import (
    install_timers,
    interleaved_rounds,
    json_args,
    per_round_ratio,
    remove_timers,
    spread,
    timed_call,
    write_json,
)
from benchmarks.model_presets import (
    DEFAULT_NUM_FRAMES,
    DEFAULT_SIZE,
    DEFAULT_VIDEO_SIZE,
    PRESETS,
    VIDEO_FAMILIES,
    build,
)
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.families import FAMILIES as FAMILY_DESCRIPTORS
from rollout.pipelines.families import family_named, family_names
from rollout.pipelines.loading import adapter_class

FAMILIES = family_names()
MODES = ("engine", "diffusers", "floor")
# The project's targets on CPU.
TARGET_SPEED_VS_DIFFUSERS = 0.95
TARGET_TIME_VS_FLOOR = 1.10
DEFAULT_BATCH_SIZE = 16
# Videos per call: a small-preset video is 9 frames of 32x32 (320 tokens, about an image's 256), a
# real one 33 frames of 480x832 (14040 tokens; RL recipes for Wan run 1-2 videos per GPU).
DEFAULT_VIDEO_BATCH_SIZE = {"small": 16, "real": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rollout_throughput",
        description=__doc__.split("\n\n")[0]
        + " Prints a table of images/s and the ratios engine/diffusers and engine/floor.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--family",
        choices=FAMILIES,
        default="sd3",
        help="the pipeline family to measure: " + ", ".join(f"{f.name} ({f.title})" for f in FAMILY_DESCRIPTORS),
    )
    model.add_argument(
        "--preset",
        choices=PRESETS,
        default="small",
        help="small: a CPU-sized transformer; real: the published transformer ("
        + ", ".join(f.real_model for f in FAMILY_DESCRIPTORS)
        + ") with random weights, for a GPU",
    )
    model.add_argument("--device", default="cpu", help="cpu or cuda[:N]; the real preset is built there too")
    model.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    run = parser.add_argument_group("what to run")
    run.add_argument(
        "--batch-size",
        type=int,
        help=f"images or videos per call (engine max_batch_size too): {DEFAULT_BATCH_SIZE}, "
        f"{DEFAULT_VIDEO_BATCH_SIZE['real']} for the real video presets",
    )
    run.add_argument("--steps", type=int, default=10, help="denoising steps per image or video")
    run.add_argument(
        "--size",
        type=int,
        help="image height and width in pixels (default: 64 for small, 512 for real; video: "
        "32x32 for small, 480x832 for real)",
    )
    run.add_argument("--height", type=int, help="height in pixels (default: --size)")
    run.add_argument("--width", type=int, help="width in pixels (default: --size)")
    run.add_argument(
        "--num-frames",
        type=int,
        help=f"video families: frames per video (default {DEFAULT_NUM_FRAMES['small']} for small, "
        f"{DEFAULT_NUM_FRAMES['real']} for real)",
    )
    run.add_argument(
        "--cfg",
        choices=("on", "off"),
        default="on",
        help="classifier-free guidance (2 x batch per forward), each family's settings for on / off: "
        + "; ".join(f"{f.name} {_fields(f.cfg_on)} / {_fields(f.cfg_off)}" for f in FAMILY_DESCRIPTORS)
        + " (FLUX.1-dev's distilled guidance_scale stays at its default either way)",
    )
    run.add_argument("--noise-level", type=float, default=0.7, help="the engine's flow_sde noise level")
    run.add_argument("--repeats", type=int, default=5, help="timed rounds; each runs all three modes once")
    run.add_argument("--warmup", type=int, default=1, help="untimed rounds first (allocator, kernels, caches)")
    run.add_argument("--prompt", default="a red cube on a blue table", help="the one prompt, sampled batch times")
    run.add_argument(
        "--peak-tflops", type=float, help="the device's dense peak TFLOP/s in --dtype: report model-FLOPs utilisation"
    )
    run.add_argument(
        "--no-breakdown", action="store_true", help="skip the extra engine run that times the worker's pieces"
    )
    run.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    video = args.family in VIDEO_FAMILIES
    if args.batch_size is None:
        args.batch_size = DEFAULT_VIDEO_BATCH_SIZE[args.preset] if video else DEFAULT_BATCH_SIZE
    if args.batch_size < 1 or args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--batch-size, --steps and --repeats must be >= 1 and --warmup >= 0")
    if args.size is not None:
        default_height = default_width = args.size
    elif video:
        default_height, default_width = DEFAULT_VIDEO_SIZE[args.preset]
    else:
        default_height = default_width = args.size = DEFAULT_SIZE[args.preset]
    args.height = default_height if args.height is None else args.height
    args.width = default_width if args.width is None else args.width
    if video and args.num_frames is None:
        args.num_frames = DEFAULT_NUM_FRAMES[args.preset]
    if not video and args.num_frames is not None:
        parser.error(f"--num-frames is for the video families ({', '.join(VIDEO_FAMILIES)})")
    return args


def is_video(args: argparse.Namespace) -> bool:
    return args.num_frames is not None


def guidance_fields(family: str, cfg: bool) -> dict:
    """SamplingParams fields (and diffusers call arguments) for CFG on or off, as the family declares them."""
    return family_named(family).guidance_fields(cfg)


def _fields(fields: dict) -> str:
    return " ".join(f"{name}={value!r}" for name, value in fields.items())


# The three modes. Each `make_*` does the untimed setup and returns a function that runs one batch.


def make_engine_run(engine: RolloutEngine, args: argparse.Namespace) -> Callable[[int], None]:
    def run(seed: int) -> None:
        params = SamplingParams(
            num_inference_steps=args.steps,
            sampler="flow_sde",
            noise_level=args.noise_level,
            num_samples=args.batch_size,
            height=args.height,
            width=args.width,
            num_frames=args.num_frames,
            seed=seed,
            return_trajectory=True,
            **guidance_fields(args.family, args.cfg == "on"),
        )
        outputs = engine.generate([args.prompt], params)
        decoded = outputs[0].video if is_video(args) else outputs[0].image
        assert len(outputs) == args.batch_size and outputs[0].trajectory is not None and decoded is not None

    return run


def on_worker_thread(engine: RolloutEngine, run: Callable[[int], None]) -> Callable[[int], None]:
    """`run`, called on the "uni" engine's worker thread, where the engine itself computes."""

    def on_worker(seed: int) -> None:
        engine.collective_rpc(lambda worker: run(seed))

    return on_worker


def make_diffusers_run(pipeline, args: argparse.Namespace) -> Callable[[int], None]:
    if is_video(args):  # WanPipeline: videos per prompt, frames out
        shape = {"num_videos_per_prompt": args.batch_size, "num_frames": args.num_frames}
    else:
        shape = {"num_images_per_prompt": args.batch_size}

    def run(seed: int) -> None:
        output = pipeline(
            prompt=args.prompt,
            num_inference_steps=args.steps,
            height=args.height,
            width=args.width,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
            **shape,
            **guidance_fields(args.family, args.cfg == "on"),
        )
        decoded = output.frames if is_video(args) else output.images
        assert len(decoded) == args.batch_size

    return run


class FloorRun:
    """`steps` rounds of the family's transformer forwards (`run_transformer`, the hook the engine's
    `predict_velocity` calls) on the rows diffusers feeds it: the batch and, with CFG, its
    unconditional copy, in one pass or two as the family's pipeline does. Calling it runs one batch.
    With several denoisers (Wan 2.2's experts) the noise levels are the real schedule's, so each step
    runs on the expert the engine and diffusers run it on."""

    def __init__(self, adapter, args: argparse.Namespace):
        fields = guidance_fields(args.family, args.cfg == "on")
        size = {"height": args.height, "width": args.width, "num_frames": args.num_frames}
        resolved, problems = adapter.spec.resolve(SamplingParams(**size, **fields))
        assert not problems, problems
        with torch.no_grad():
            prompts = [adapter.encode_prompt(args.prompt, resolved.max_sequence_length)] * args.batch_size
            negatives = []
            if resolved.negative_prompt is not None:
                negatives = [adapter.encode_prompt(resolved.negative_prompt, resolved.max_sequence_length)]
                negatives *= args.batch_size
        embeds_type = type(prompts[0])
        passes = [prompts + negatives] if adapter.cfg_in_one_pass else [prompts, negatives]
        self.passes = [embeds_type.stack(rows) for rows in passes if rows]
        shape = adapter.spec.latent_shape(args.height, args.width, args.num_frames)
        rows = 2 * args.batch_size if negatives else args.batch_size
        latents = torch.randn(rows, *shape, generator=torch.Generator().manual_seed(0))
        self.latents = latents.to(adapter.device, adapter.dtype)
        self.guidance = None
        if resolved.guidance_scale is not None:
            self.guidance = torch.full((rows,), resolved.guidance_scale, device=adapter.device)
        if len(adapter.denoisers) > 1:
            _, sigmas = adapter.schedule(args.steps, args.height, args.width)
            self.sigmas = sigmas[:-1].to(adapter.device)
        else:
            self.sigmas = torch.linspace(1.0, 0.1, args.steps).to(adapter.device)
        self.adapter, self.height, self.width = adapter, args.height, args.width

    def forward(self, sigma: torch.Tensor) -> None:
        for embeds in self.passes:
            rows = embeds.prompt_embeds.shape[0]
            guidance = self.guidance[:rows] if self.guidance is not None else None
            self.adapter.run_transformer(
                self.latents[:rows], sigma.expand(rows), embeds, guidance, self.height, self.width
            )

    @torch.no_grad()
    def __call__(self, seed: int) -> None:
        for sigma in self.sigmas:
            self.forward(sigma)


def forward_flops(floor: FloorRun) -> float:
    """FLOPs of one step's transformer forwards on the floor's rows (matmuls and attention, as torch
    counts them)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        floor.forward(floor.sigmas[0])
    return float(counter.get_total_flops())


def time_rounds(
    runs: dict[str, Callable[[int], None]], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[tuple[int, int]]]]:
    """Seconds per batch for each mode over the timed rounds, and on CUDA each timed call's memory:
    (bytes allocated when it began, its peak bytes allocated)."""
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    memory: dict[str, list[tuple[int, int]]] = {mode: [] for mode in runs}
    cuda = args.device.startswith("cuda")
    for round_ in interleaved_rounds(runs, args.warmup, args.repeats):
        for mode in round_.order:
            if cuda:
                gc.collect()
                torch.cuda.synchronize(args.device)
                torch.cuda.reset_peak_memory_stats(args.device)
                start = torch.cuda.memory_allocated(args.device)
            _, elapsed = timed_call(runs[mode], round_.index, device=args.device)
            peak = torch.cuda.max_memory_allocated(args.device) if cuda else None
            if round_.timed:
                times[mode].append(elapsed)
                if cuda:
                    memory[mode].append((start, peak))
            above = f", peak +{(peak - start) / 2**30:.2f} GiB" if cuda else ""
            print(f"  [{round_.tag}] {mode:<9} {elapsed:7.2f} s{above}", flush=True)
    return times, memory


# The breakdown: timers on the worker's pieces (see benchmarks.common.install_timers).

_TIMED_PIECES = (
    ("execute", "execute"),
    ("prepare", "runner.prepare"),
    ("encode_prompts", "adapter.encode_prompts"),
    ("step", "runner.step"),
    ("predict_velocity", "adapter.predict_velocity"),
    ("transformer", "adapter.transformer.forward"),
    ("finish", "runner.finish"),
    ("decode", "adapter.decode"),
)


def engine_breakdown(
    engine: RolloutEngine, run: Callable[[int], None], args: argparse.Namespace, denoisers: list[str]
) -> dict:
    """One engine batch with timers: seconds per piece (pieces nest; `other` rows are the rest). The
    forwards of every denoiser (Wan 2.2: both experts) count as `transformer`."""
    pieces = _TIMED_PIECES + tuple((name, f"adapter.pipeline.{name}.forward") for name in denoisers[1:])
    engine.collective_rpc(install_timers, args=(pieces, args.device))
    try:
        gc.collect()
        start = time.perf_counter()
        run(args.warmup + args.repeats)
        wall = time.perf_counter() - start
    finally:
        timings = engine.collective_rpc(remove_timers)[0]
    for name in denoisers[1:]:
        timings["transformer"] += timings.pop(name)
    s = {name: sum(seconds) for name, seconds in timings.items()}
    rows = {
        "outside the worker (scheduler, executor hop, outputs)": wall - s["execute"],
        "prepare: encode prompts": s["encode_prompts"],
        "prepare: initial noise, schedules": s["prepare"] - s["encode_prompts"],
        "step: transformer forwards": s["transformer"],
        "step: CFG cat/index/combine in predict_velocity": s["predict_velocity"] - s["transformer"],
        "step: stacking, step noise, sampler, history": s["step"] - s["predict_velocity"],
        "finish: VAE decode": s["decode"],
        "finish: trajectories to CPU": s["finish"] - s["decode"],
        "execute: frees, state bookkeeping": s["execute"] - s["prepare"] - s["step"] - s["finish"],
    }
    return {"wall_s": wall, "rows": rows, "calls": {name: len(seconds) for name, seconds in timings.items()}}


# Reporting.


def summarize(
    times: dict[str, list[float]],
    batch_size: int,
    num_frames: int | None = None,
    memory: dict[str, list[tuple[int, int]]] | None = None,
) -> dict[str, dict]:
    """Per mode: time spread, images/s (video: videos/s and frames/s), and with `memory` (CUDA) the
    largest peak above the start of a call and the largest absolute peak, in GiB."""
    summary = {}
    for mode, values in times.items():
        per_s = batch_size / statistics.median(values)
        if num_frames is None:
            row = {**spread(values), "images_per_s": per_s}
        else:
            row = {**spread(values), "videos_per_s": per_s, "frames_per_s": per_s * num_frames}
        if memory and memory[mode]:
            row["peak_above_start_gib"] = max(peak - start for start, peak in memory[mode]) / 2**30
            row["peak_gib"] = max(peak for _, peak in memory[mode]) / 2**30
            row["allocated_at_start_gib"] = min(start for start, _ in memory[mode]) / 2**30
        summary[mode] = row | {"times_s": values}
    return summary


def ratios_of(summary: dict[str, dict], times: dict[str, list[float]]) -> dict[str, float]:
    """Ratios from the medians (the headline), from the minima (the least disturbed runs), and the
    median of per-round ratios (runs of one round are seconds apart, so they share the machine's
    load)."""
    engine, diffusers, floor = (summary[mode] for mode in MODES)
    return {
        "engine_speed_vs_diffusers": diffusers["median_s"] / engine["median_s"],
        "engine_time_vs_floor": engine["median_s"] / floor["median_s"],
        "diffusers_time_vs_floor": diffusers["median_s"] / floor["median_s"],
        "engine_speed_vs_diffusers_min": diffusers["min_s"] / engine["min_s"],
        "engine_time_vs_floor_min": engine["min_s"] / floor["min_s"],
        "engine_speed_vs_diffusers_per_round": per_round_ratio(times["diffusers"], times["engine"]),
        "engine_time_vs_floor_per_round": per_round_ratio(times["engine"], times["floor"]),
    }


def utilisation(summary: dict[str, dict], flops: float, args: argparse.Namespace) -> dict[str, float]:
    """Model-FLOPs utilisation of each mode: the transformer's FLOPs per batch over its time."""
    per_batch = flops * args.steps
    return {mode: per_batch / summary[mode]["median_s"] / (args.peak_tflops * 1e12) for mode in MODES}


def print_report(summary, ratios, breakdown, mfu, label: str) -> None:
    floor_median = summary["floor"]["median_s"]
    labels = {
        "engine": "engine (uni, flow_sde, trajectory)",
        "diffusers": f"diffusers {label} (ODE)",
        "floor": "transformer forwards only",
    }
    video = "frames_per_s" in summary["engine"]
    memory = "peak_above_start_gib" in summary["engine"]
    rates = (("videos/s", "videos_per_s"), ("frames/s", "frames_per_s")) if video else (("images/s", "images_per_s"),)
    header = f"{'mode':<42} {'median s':>9} {'min s':>8} {'max s':>8}"
    header += "".join(f" {title:>9}" for title, _ in rates) + f" {'x floor':>8}"
    header += f" {'MFU':>6}" if mfu else ""
    header += f" {'peak +GiB':>9}" if memory else ""
    print("\n" + header)
    print("-" * len(header))
    for mode in MODES:
        row = summary[mode]
        line = f"{labels[mode]:<42} {row['median_s']:>9.3f} {row['min_s']:>8.3f} {row['max_s']:>8.3f}"
        line += "".join(f" {row[key]:>9.3f}" for _, key in rates) + f" {row['median_s'] / floor_median:>8.3f}"
        line += f" {100 * mfu[mode]:>5.1f}%" if mfu else ""
        print(line + (f" {row['peak_above_start_gib']:>9.2f}" if memory else ""))
    if memory:
        at_start = min(summary[mode]["allocated_at_start_gib"] for mode in MODES)
        peak = max(summary[mode]["peak_gib"] for mode in MODES)
        print(
            f"peak +GiB: a call's memory peak above what was allocated when it began. Allocated between calls\n"
            f"(the engine's and the diffusers pipeline's copies of the weights): {at_start:.2f} GiB; highest peak: "
            f"{peak:.2f} GiB"
        )
    speed_ok = ratios["engine_speed_vs_diffusers"] >= TARGET_SPEED_VS_DIFFUSERS
    floor_ok = ratios["engine_time_vs_floor"] <= TARGET_TIME_VS_FLOOR
    header = f"{'ratio':<28} {'medians':>8} {'minima':>8} {'per-round':>10}   target (on medians)"
    print("\n" + header)
    print("-" * len(header))
    for text, key, target, ok in (
        ("engine / diffusers speed", "engine_speed_vs_diffusers", f">= {TARGET_SPEED_VS_DIFFUSERS}", speed_ok),
        ("engine time / floor time", "engine_time_vs_floor", f"<= {TARGET_TIME_VS_FLOOR}", floor_ok),
    ):
        print(
            f"{text:<28} {ratios[key]:>8.3f} {ratios[key + '_min']:>8.3f} {ratios[key + '_per_round']:>10.3f}"
            f"   {target}: {'met' if ok else 'MISSED'}"
        )
    print(f"{'diffusers time / floor time':<28} {ratios['diffusers_time_vs_floor']:>8.3f}")
    if breakdown is not None:
        wall = breakdown["wall_s"]
        print(f"\nengine breakdown (one extra batch with timers, {wall:.3f} s wall):")
        for name, seconds in breakdown["rows"].items():
            print(f"  {name:<52} {seconds:>8.3f} s {100 * seconds / wall:>6.1f} %")
        calls = breakdown["calls"]
        print(
            f"  transformer calls: {calls['transformer']}, steps: {calls['step']}, "
            f"engine steps (execute calls): {calls['execute']}"
        )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import diffusers
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, dtype {args.dtype}")
    frames = f" x {args.num_frames} frames" if is_video(args) else ""
    print(
        f"family {args.family}, preset {args.preset}, batch {args.batch_size}, steps {args.steps}, "
        f"{args.height}x{args.width}{frames}, CFG {args.cfg}, rounds {args.warmup} warmup + {args.repeats} timed"
    )
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as folder:
        build(args.family, args.preset, folder, args.device, dtype)
        class_name = json.loads((Path(folder) / "model_index.json").read_text())["_class_name"]
        pipeline = getattr(diffusers, class_name).from_pretrained(folder, dtype=dtype, local_files_only=True)
        pipeline.to(args.device)
        pipeline.set_progress_bar_config(disable=True)
        params = sum(p.numel() for p in pipeline.transformer.parameters())
        adapter = adapter_class(class_name)(pipeline)
        denoisers = list(adapter.denoisers)
        experts = f" (each of {len(denoisers)} experts: {', '.join(denoisers)})" if len(denoisers) > 1 else ""
        print(f"{class_name}, transformer parameters: {params / 1e6:.2f}M{experts}")
        config = EngineConfig(
            model=folder, executor="uni", device=args.device, dtype=args.dtype, max_batch_size=args.batch_size
        )
        floor = FloorRun(adapter, args)
        flops = forward_flops(floor) if args.peak_tflops else None
        with RolloutEngine(config) as engine:
            runs = {
                "engine": make_engine_run(engine, args),
                "diffusers": on_worker_thread(engine, make_diffusers_run(pipeline, args)),
                "floor": on_worker_thread(engine, floor),
            }
            times, memory = time_rounds(runs, args)
            breakdown = None if args.no_breakdown else engine_breakdown(engine, runs["engine"], args, denoisers)
    summary = summarize(times, args.batch_size, args.num_frames, memory)
    ratios = ratios_of(summary, times)
    mfu = utilisation(summary, flops, args) if flops else None
    print_report(summary, ratios, breakdown, mfu, class_name)
    result = {
        "args": json_args(args),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pipeline_class": class_name,
        "transformer_parameters": params,
        "denoisers": denoisers,
        "transformer_forward_flops": flops,
        "modes": summary,
        "ratios": ratios,
        "mfu": mfu,
        "breakdown": breakdown,
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
