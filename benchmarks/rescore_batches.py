"""Re-scoring at the trainer's micro-batches, and one prompt alone vs. in a batch.

Builds a pipeline of the chosen family (random weights, see benchmarks/model_presets.py) in a
temporary folder, samples one batch of `--batch-size` prompts (one request each, flow_sde on every
step, trajectories kept) with classifier-free guidance on and off as the family turns it on and off,
and then measures two things a trainer's numbers depend on:

  re-score    the trainer's own copy of the model (`load_adapter`, as `LoraPolicy` loads it; in
              --dtype on --device, with the same --attention-backend) re-scores every stochastic
              transition of every trajectory with `rollout.rescoring`'s functions: at micro-batches
              of 1, 2, 4 and 16 trajectories per forward (`score_steps` at one step index, as a
              Flow-GRPO trainer loops over steps and batches samples), and one trajectory's steps per
              forward (`recompute_log_probs`, the documented path). Reported: the largest
              |log-ratio| = |re-scored - sampled log-prob| over all transitions, per micro-batch.
              Target: each <= the contract's 1e-5 (RATIO_TOLERANCE).
  alone       the batch's first request sampled again alone (the same prompt, seed, prompt index
              and so the same noise): the largest absolute difference of its final latents from
              those the batch gave it. A kernel that rounds differently at another batch size
              moves them; a trainer that scores with micro-batches shaped otherwise than the
              rollout's batches then sees that difference in its ratio.

Re-scoring runs under `torch.no_grad()` (the same kernels as with gradients). The engine runs on
executor "uni"; its batches hold --batch-size requests (`max_batch_size`). With --compile blocks the
engine samples with compiled transformer blocks (`EngineConfig.compile`) and two trainer copies
re-score: one compiled the same way (`load_adapter(compile="blocks")`) and one eager, the bound a
trainer that does not compile gets.

    python -m benchmarks.rescore_batches                            # SD3, CPU-sized, float32
    python -m benchmarks.rescore_batches --family flux --attention-backend _native_math
    python -m benchmarks.rescore_batches --preset real --device cuda --dtype bfloat16   # SD3.5 Medium
    python -m benchmarks.rescore_batches --preset real --device cuda --dtype bfloat16 --compile blocks
    python -m benchmarks.rescore_batches --family flux --preset real --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack

import torch

from benchmarks import harness, model_presets
from benchmarks.model_presets import PRESETS, VIDEO_FAMILIES
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.families import FAMILIES as FAMILY_DESCRIPTORS
from rollout.pipelines.families import families_of, family_named
from rollout.pipelines.loading import load_adapter
from rollout.pipelines.model_index import read_model_index
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs, score_steps

FAMILIES = tuple(family.name for family in FAMILY_DESCRIPTORS if not family.edits)
MICRO_BATCHES = (1, 2, 4, 16)
PER_TRAJECTORY = "per trajectory"  # recompute_log_probs: one trajectory's stochastic steps per forward
DEFAULT_STEPS = {"small": 2, "real": 10}
DEFAULT_SIZE = {"small": 32, "real": 512}  # small: 64 image tokens, so the run takes seconds on a CPU


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser("rescore_batches", __doc__, device="cpu", dtype="float32", model=None, model_folder=None)
    titles = ", ".join(f"{f.name} ({f.title})" for f in FAMILY_DESCRIPTORS if f.name in FAMILIES)
    parser.add_argument("--family", choices=FAMILIES, default="sd3", help=f"the pipeline family: {titles}")
    real = ", ".join(f.real_model for f in FAMILY_DESCRIPTORS if f.name in FAMILIES)
    parser.add_argument("--preset", choices=PRESETS, default="small", help=f"small: CPU-sized; real: {real} (GPU)")
    parser.add_argument("--batch-size", type=harness.positive_int, default=16, help="requests in the one rollout")
    parser.add_argument("--steps", type=harness.positive_int, help="denoising steps (2 small, 10 real)")
    parser.add_argument("--size", type=int, help="height and width (32 small, 512 real; video 32x32, 480x832)")
    parser.add_argument("--num-frames", type=int, help="video families: frames per video (9 small, 33 real)")
    parser.add_argument("--noise-level", type=float, default=0.7, help="flow_sde's noise level")
    parser.add_argument(
        "--cfg", choices=("both", "on", "off"), default="both", help="guidance: the family's cfg_on/off"
    )
    parser.add_argument(
        "--attention-backend",
        help="diffusers' attention dispatcher name for the engine and the trainer's copy alike "
        "(EngineConfig.attention_backend); default: diffusers' own",
    )
    parser.add_argument(
        "--compile",
        choices=("off", "blocks"),
        default="off",
        help="'blocks': the engine samples with compiled transformer blocks, and a compiled and an eager trainer "
        "copy re-score",
    )
    parser.add_argument("--seed", type=int, default=0, help="the rollout's base seed")
    args = parser.parse_args(argv)
    if args.model is not None and args.model_folder is not None:
        parser.error("give --model (a pipeline folder to use) or --model-folder (where to build one), not both")
    if args.model is not None:  # its family is the folder's, whatever --family says
        args.family = families_of(read_model_index(args.model)["_class_name"])[0].name
        if args.family not in FAMILIES:
            parser.error(
                f"--model {args.model} is an edit pipeline ({args.family}); this benchmark samples text to image"
            )
    video = args.family in VIDEO_FAMILIES
    if not video and args.num_frames is not None:
        parser.error(f"--num-frames is for the video families ({', '.join(VIDEO_FAMILIES)})")
    args.steps = args.steps or DEFAULT_STEPS[args.preset]
    if video:
        args.height, args.width = (
            (args.size, args.size) if args.size else model_presets.DEFAULT_VIDEO_SIZE[args.preset]
        )
        args.num_frames = args.num_frames or model_presets.DEFAULT_NUM_FRAMES[args.preset]
    else:
        args.height = args.width = args.size or DEFAULT_SIZE[args.preset]
    return args


def sampling_params(args: argparse.Namespace, cfg: bool) -> SamplingParams:
    frames = {} if args.num_frames is None else {"num_frames": args.num_frames}
    return SamplingParams(
        sampler="flow_sde",
        noise_level=args.noise_level,
        num_inference_steps=args.steps,
        height=args.height,
        width=args.width,
        seed=args.seed,
        **frames,
        **family_named(args.family).guidance_fields(cfg),
    )


def prompts(count: int) -> list[str]:
    colours = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
    things = ("cube", "sphere", "cat", "house")
    return [
        f"a {colours[i % len(colours)]} {things[i // len(colours) % len(things)]}, picture {i}" for i in range(count)
    ]


def max_log_ratio(adapter, trajectories: list, micro_batch: int | str, device: str) -> tuple[float, float]:
    """The largest |re-scored - sampled| log-prob over every stochastic transition of
    `trajectories`, scored `micro_batch` trajectories per forward at one step index (or, with
    PER_TRAJECTORY, one trajectory's steps per forward); and the seconds it took."""
    worst = 0.0
    start = time.perf_counter()
    with torch.no_grad():
        if micro_batch == PER_TRAJECTORY:
            for trajectory in trajectories:
                steps = trajectory.scorable_steps
                scored = recompute_log_probs(adapter, trajectory)
                worst = max(worst, (scored[steps] - trajectory.log_probs[steps]).abs().max().item())
        else:
            for step in trajectories[0].scorable_steps.tolist():
                for begin in range(0, len(trajectories), micro_batch):
                    chunk = trajectories[begin : begin + micro_batch]
                    scored = score_steps(adapter, chunk, [step] * len(chunk)).log_prob.float().cpu()
                    sampled = torch.stack([t.log_probs[step] for t in chunk])
                    worst = max(worst, (scored - sampled).abs().max().item())
    harness.synchronize(device)
    return worst, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    report = harness.Report("rescore_batches", args, __doc__, argv)
    backend = args.attention_backend or "diffusers' default"
    shape = f"{args.height}x{args.width}" + (f"x{args.num_frames} frames" if args.num_frames else "")
    report.note(
        f"family {args.family}, preset {args.preset}, {args.dtype} on {args.device}, batch {args.batch_size}, "
        f"{args.steps} steps, {shape}, flow_sde (noise level {args.noise_level}) on every step, attention "
        f"backend {backend}, compile {args.compile}"
    )
    guidance = {"both": (True, False), "on": (True,), "off": (False,)}[args.cfg]
    dtype = getattr(torch, args.dtype)
    with ExitStack() as stack:
        if args.model is None:
            folder = str(
                stack.enter_context(
                    model_presets.built(args.family, args.preset, args.device, dtype, args.model_folder)
                )
            )
        else:
            folder = str(args.model)
        config = EngineConfig(
            model=folder,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.batch_size,
            attention_backend=args.attention_backend,
            compile=args.compile,
        )
        with RolloutEngine(config) as engine:
            batches, alone = {}, {}
            for cfg in guidance:
                params = sampling_params(args, cfg)
                batches[cfg], batch_s = harness.timed_call(
                    engine.generate, prompts(args.batch_size), params, device=args.device
                )
                alone[cfg], _ = harness.timed_call(engine.generate, prompts(1), params, device=args.device)
                report.note(f"CFG {'on' if cfg else 'off'}: the batch of {args.batch_size} took {batch_s:.2f} s")
        # Result key -> (the trainer's compile, its copy): compiled as the engine is, and with
        # --compile blocks an eager one too.
        trainers = {
            "rescore": (args.compile, load_adapter(folder, args.device, dtype, args.attention_backend, args.compile))
        }
        if args.compile == "blocks":
            trainers["rescore_eager_trainer"] = (
                "off",
                load_adapter(folder, args.device, dtype, args.attention_backend),
            )
        rows, results = [], {}
        for cfg in guidance:
            trajectories = [output.trajectory for output in batches[cfg]]
            name = "on" if cfg else "off"
            results[name] = {"alone": None}
            for key, (mode, trainer) in trainers.items():
                results[name][key] = {}
                for micro_batch in (*[m for m in MICRO_BATCHES if m <= args.batch_size], PER_TRAJECTORY):
                    worst, seconds = max_log_ratio(trainer, trajectories, micro_batch, args.device)
                    rows.append([name, mode, micro_batch, worst, seconds])
                    results[name][key][str(micro_batch)] = {"max_abs_log_ratio": worst, "s": seconds}
                    report.check(
                        harness.Target(
                            f"CFG {name}, trainer {mode}, micro-batch {micro_batch}: max |log-ratio|",
                            worst,
                            "<=",
                            RATIO_TOLERANCE,
                        )
                    )
            difference = (alone[cfg][0].trajectory.latents[-1] - batches[cfg][0].trajectory.latents[-1]).abs().max()
            results[name]["alone"] = difference.item()
    report.table(
        "re-scored by the trainer's copy: the largest abs log-ratio over every stochastic transition",
        ["CFG", "trainer compile", "micro-batch", "max abs log-ratio", "seconds"],
        rows,
        note=f"micro-batch m: m trajectories at one step index per forward (score_steps); {PER_TRAJECTORY}: "
        "one trajectory's steps per forward (recompute_log_probs). The engine sampled them "
        f"{args.batch_size} per forward. Seconds: this machine's wall time of each re-scoring pass.",
    )
    report.table(
        f"one prompt alone vs. the same request in a batch of {args.batch_size}",
        ["CFG", "max abs difference of the final latents"],
        [[name, results[name]["alone"]] for name in results],
        note="the same request (prompt, seed, noise) sampled in a batch of 1 and in the batch: its final latents",
    )
    report.results = results
    return report.finish()


if __name__ == "__main__":
    main()
