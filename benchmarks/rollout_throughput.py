"""Rollout throughput: the engine vs. plain diffusers vs. the transformer forwards alone.

Builds a small SD3 pipeline (random weights; a transformer big enough to dominate the time, tiny
VAE and text encoders) in a temporary folder and measures, at the same batch size, steps and
guidance:

  engine     `RolloutEngine` (executor "uni"), sampler flow_sde, trajectories recorded, images decoded;
  diffusers  `StableDiffusion3Pipeline` from the same folder, ODE sampling, output_type="np";
  floor      the same number of transformer calls on the same input shapes (2 x batch with CFG),
             embeddings precomputed, under torch.no_grad: what any sampler must at least spend.

The three are interleaved (each round runs all three, in a rotated order) so machine noise hits all
alike; warmup rounds are discarded and the median of the timed rounds is reported. Afterwards one
more engine run with timers on the worker's pieces shows where the engine spends its time beyond
the floor.

    python -m benchmarks.rollout_throughput               # batch 16, 10 steps, 1 + 5 rounds
    python -m benchmarks.rollout_throughput --json out.json
"""

from __future__ import annotations

import argparse
import gc
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
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.tiny import TinySD3Sizes, build_tiny_sd3

MODES = ("engine", "diffusers", "floor")
MODE_LABELS = {
    "engine": "engine (uni, flow_sde, trajectory)",
    "diffusers": "diffusers SD3 pipeline (ODE)",
    "floor": "transformer forwards only",
}
# The project's targets at batch 16.
TARGET_SPEED_VS_DIFFUSERS = 0.95
TARGET_TIME_VS_FLOOR = 1.15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rollout_throughput",
        description=__doc__.split("\n\n")[0]
        + " Prints a table of images/s and the ratios engine/diffusers and engine/floor.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = parser.add_argument_group("what to run")
    run.add_argument("--batch-size", type=int, default=16, help="images per call (engine max_batch_size too)")
    run.add_argument("--steps", type=int, default=10, help="denoising steps per image")
    run.add_argument("--guidance-scale", type=float, default=4.5, help="CFG scale (> 1: 2 x batch per forward)")
    run.add_argument("--noise-level", type=float, default=0.7, help="the engine's flow_sde noise level")
    run.add_argument("--repeats", type=int, default=5, help="timed rounds; each runs all three modes once")
    run.add_argument("--warmup", type=int, default=1, help="untimed rounds first (allocator, kernels, caches)")
    run.add_argument("--prompt", default="a red cube on a blue table", help="the one prompt, sampled batch times")
    run.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    run.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    run.add_argument(
        "--no-breakdown", action="store_true", help="skip the extra engine run that times the worker's pieces"
    )
    run.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    sizes = parser.add_argument_group(
        "model sizes", "the SD3 transformer's shape; the VAE and the two CLIP encoders stay tiny"
    )
    sizes.add_argument("--sample-size", type=int, default=32, help="latent height and width (image is 2x)")
    sizes.add_argument("--patch-size", type=int, default=2, help="transformer patch size")
    sizes.add_argument("--num-layers", type=int, default=4, help="transformer blocks")
    sizes.add_argument("--num-heads", type=int, default=4, help="attention heads")
    sizes.add_argument("--head-dim", type=int, default=32, help="width of one head (hidden = heads x head-dim)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--batch-size, --steps and --repeats must be >= 1 and --warmup >= 0")
    return args


def benchmark_sizes(args: argparse.Namespace) -> TinySD3Sizes:
    return TinySD3Sizes(
        sample_size=args.sample_size,
        patch_size=args.patch_size,
        num_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        attention_head_dim=args.head_dim,
    )


# The three modes. Each `make_*` does the untimed setup and returns a function that runs one batch.


def make_engine_run(engine: RolloutEngine, args: argparse.Namespace) -> Callable[[int], None]:
    def run(seed: int) -> None:
        params = SamplingParams(
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            sampler="flow_sde",
            noise_level=args.noise_level,
            num_samples=args.batch_size,
            seed=seed,
            return_trajectory=True,
            return_image=True,
        )
        outputs = engine.generate([args.prompt], params)
        assert len(outputs) == args.batch_size and outputs[0].trajectory is not None and outputs[0].image is not None

    return run


def make_diffusers_run(pipeline, args: argparse.Namespace) -> Callable[[int], None]:
    def run(seed: int) -> None:
        images = pipeline(
            prompt=args.prompt,
            num_images_per_prompt=args.batch_size,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
        ).images
        assert len(images) == args.batch_size

    return run


def make_floor_run(pipeline, args: argparse.Namespace) -> Callable[[int], None]:
    """`steps` transformer calls on what diffusers feeds it: the CFG batch (negative first)."""
    device = pipeline.transformer.device
    dtype = pipeline.transformer.dtype
    with torch.no_grad():
        embeds, negative, pooled, negative_pooled = pipeline.encode_prompt(
            prompt=args.prompt,
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=args.batch_size,
            do_classifier_free_guidance=True,
        )
    cfg = args.guidance_scale > 1
    copies = 2 if cfg else 1
    encoder_hidden_states = torch.cat([negative, embeds] if cfg else [embeds]).to(dtype)
    pooled_projections = torch.cat([negative_pooled, pooled] if cfg else [pooled]).to(dtype)
    config = pipeline.transformer.config
    latents = torch.randn(
        copies * args.batch_size,
        config.in_channels,
        args.sample_size,
        args.sample_size,
        generator=torch.Generator("cpu").manual_seed(0),
    ).to(device, dtype)
    timesteps = torch.linspace(1000, 100, args.steps, device=device)

    def run(seed: int) -> None:
        with torch.no_grad():
            for t in timesteps:
                pipeline.transformer(
                    hidden_states=latents,
                    timestep=t.expand(latents.shape[0]),
                    encoder_hidden_states=encoder_hidden_states,
                    pooled_projections=pooled_projections,
                    return_dict=False,
                )

    return run


def time_rounds(runs: dict[str, Callable[[int], None]], args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per batch for each mode, over the timed rounds."""
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for round_ in interleaved_rounds(runs, args.warmup, args.repeats):
        for mode in round_.order:
            _, elapsed = timed_call(runs[mode], round_.index, device=args.device)
            if round_.timed:
                times[mode].append(elapsed)
            print(f"  [{round_.tag}] {mode:<9} {elapsed:7.2f} s", flush=True)
    return times


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


def engine_breakdown(engine: RolloutEngine, run: Callable[[int], None], args: argparse.Namespace) -> dict:
    """One engine batch with timers: seconds per piece (pieces nest; `other` rows are the rest)."""
    engine.collective_rpc(install_timers, args=(_TIMED_PIECES, args.device))
    try:
        gc.collect()
        start = time.perf_counter()
        run(args.warmup + args.repeats)
        wall = time.perf_counter() - start
    finally:
        timings = engine.collective_rpc(remove_timers)[0]
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


def summarize(times: dict[str, list[float]], batch_size: int) -> dict[str, dict]:
    return {
        mode: {**spread(values), "images_per_s": batch_size / statistics.median(values), "times_s": values}
        for mode, values in times.items()
    }


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


def print_report(summary: dict[str, dict], ratios: dict[str, float], breakdown: dict | None) -> None:
    floor_median = summary["floor"]["median_s"]
    header = f"{'mode':<36} {'median s':>9} {'min s':>8} {'max s':>8} {'images/s':>9} {'x floor':>8}"
    print("\n" + header)
    print("-" * len(header))
    for mode in MODES:
        row = summary[mode]
        print(
            f"{MODE_LABELS[mode]:<36} {row['median_s']:>9.3f} {row['min_s']:>8.3f} {row['max_s']:>8.3f} "
            f"{row['images_per_s']:>9.3f} {row['median_s'] / floor_median:>8.3f}"
        )
    speed_ok = ratios["engine_speed_vs_diffusers"] >= TARGET_SPEED_VS_DIFFUSERS
    floor_ok = ratios["engine_time_vs_floor"] <= TARGET_TIME_VS_FLOOR
    header = f"{'ratio':<28} {'medians':>8} {'minima':>8} {'per-round':>10}   target (on medians)"
    print("\n" + header)
    print("-" * len(header))
    for label, key, target, ok in (
        ("engine / diffusers speed", "engine_speed_vs_diffusers", f">= {TARGET_SPEED_VS_DIFFUSERS}", speed_ok),
        ("engine time / floor time", "engine_time_vs_floor", f"<= {TARGET_TIME_VS_FLOOR}", floor_ok),
    ):
        print(
            f"{label:<28} {ratios[key]:>8.3f} {ratios[key + '_min']:>8.3f} {ratios[key + '_per_round']:>10.3f}"
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
    from diffusers import StableDiffusion3Pipeline
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    sizes = benchmark_sizes(args)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, dtype {args.dtype}")
    print(
        f"batch {args.batch_size}, steps {args.steps}, guidance {args.guidance_scale}, "
        f"rounds {args.warmup} warmup + {args.repeats} timed"
    )
    print(f"sizes: {sizes}")
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as folder:
        build_tiny_sd3(folder, seed=0, sizes=sizes)
        pipeline = StableDiffusion3Pipeline.from_pretrained(
            folder, dtype=dtype, text_encoder_3=None, tokenizer_3=None, local_files_only=True
        ).to(args.device)
        pipeline.set_progress_bar_config(disable=True)
        params = sum(p.numel() for p in pipeline.transformer.parameters())
        print(f"transformer parameters: {params / 1e6:.2f}M")
        config = EngineConfig(
            model=folder,
            executor="uni",
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.batch_size,
        )
        with RolloutEngine(config) as engine:
            runs = {
                "engine": make_engine_run(engine, args),
                "diffusers": make_diffusers_run(pipeline, args),
                "floor": make_floor_run(pipeline, args),
            }
            times = time_rounds(runs, args)
            breakdown = None if args.no_breakdown else engine_breakdown(engine, runs["engine"], args)
    summary = summarize(times, args.batch_size)
    ratios = ratios_of(summary, times)
    print_report(summary, ratios, breakdown)
    result = {
        "args": json_args(args),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformer_parameters": params,
        "modes": summary,
        "ratios": ratios,
        "breakdown": breakdown,
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
