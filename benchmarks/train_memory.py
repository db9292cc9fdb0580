"""The memory peak of a GRPO train step with and without gradient checkpointing in the trainer.

For each preset, builds the family's pipeline (random weights: `tiny`, the tests' pipeline; `small`
and `real`, see benchmarks/model_presets.py), samples one rollout with the policy's adapter
(`--prompts` groups of `--micro-batch-size` samples, flow_sde on each of `--steps` steps, rewarded
by the colour reward), closes the engine, and then runs `grpo_step` (one optimizer step, micro-batches
of `--micro-batch-size` transitions, Flow-GRPO's KL weight 0.04) on two `LoraPolicy` copies with the
same initial LoRA: one plain, one with `gradient_checkpointing=True` (`trainer.gradient_checkpointing`
in a recipe).

  peak     the most bytes torch's allocator held at once during the step, above what it held when the
           step began (the weights, the LoRA, AdamW's states after the warm-up round): the activations
           kept from a micro-batch's forward for its backward, the recomputation's, the gradients and
           the step's temporaries. On the CPU through torch's profiler (benchmarks/allocation_peak.py:
           every allocation and free, summed in order, exact and the same on every run); on a GPU
           `torch.cuda.max_memory_allocated`. Not the process's RSS.
  seconds  the step's wall time (the recomputation costs about one more forward of the blocks).

Targets: the checkpointed peak below the plain one at every preset, and the two copies' LoRA tensors
after the same steps within 1e-6 of each other (relative, over all tensors: the same gradients).

    python -m benchmarks.train_memory                              # SD3: tiny and small, CPU
    python -m benchmarks.train_memory --family flux --presets small
    python -m benchmarks.train_memory --presets real --device cuda --dtype bfloat16 --micro-batch-size 2
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks import harness, model_presets
from benchmarks.allocation_peak import AllocationPeak
from benchmarks.model_presets import PRESETS
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.families import FAMILIES as FAMILY_DESCRIPTORS
from rollout.pipelines.families import family_named
from trainers_adapters.grpo.settings import GRPOSettings
from trainers_adapters.grpo.trainer import grpo_step
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards

FAMILIES = tuple(family.name for family in FAMILY_DESCRIPTORS if not family.edits)
MODES = {"plain": False, "checkpointed": True}
LORA = {"r": 8, "lora_alpha": 16, "init_lora_weights": False}  # B != 0: every LoRA tensor gets a gradient
TINY_SIZE = {"image": (32, 32), "video": (32, 32)}
TINY_NUM_FRAMES = 9
LORA_TOLERANCE = 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser("train_memory", __doc__, repeats=2, warmup=1, device="cpu", dtype="float32")
    titles = ", ".join(f"{f.name} ({f.title})" for f in FAMILY_DESCRIPTORS if f.name in FAMILIES)
    parser.add_argument("--family", choices=FAMILIES, default="sd3", help=f"the pipeline family: {titles}")
    parser.add_argument(
        "--presets", nargs="+", choices=("tiny", *PRESETS), default=["tiny", "small"], help="the pipelines, in turn"
    )
    parser.add_argument("--prompts", type=harness.positive_int, default=1, help="groups in the rollout")
    parser.add_argument(
        "--micro-batch-size", type=harness.positive_int, default=4, help="samples per group, transitions per forward"
    )
    parser.add_argument("--steps", type=harness.positive_int, default=2, help="denoising steps (each an SDE step)")
    return parser.parse_args(argv)


@contextlib.contextmanager
def pipeline(family: str, preset: str, device: str, dtype: torch.dtype) -> Iterator[Path]:
    if preset != "tiny":
        with model_presets.built(family, preset, device, dtype) as folder:
            yield folder
        return
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as scratch:
        yield family_named(family).build_tiny(Path(scratch) / "pipeline", seed=0)


def sampling_params(args: argparse.Namespace, preset: str) -> SamplingParams:
    descriptor = family_named(args.family)
    if preset == "tiny":
        (height, width), frames = TINY_SIZE["video" if descriptor.video else "image"], TINY_NUM_FRAMES
    elif descriptor.video:
        (height, width), frames = model_presets.DEFAULT_VIDEO_SIZE[preset], model_presets.DEFAULT_NUM_FRAMES[preset]
    else:
        height = width = model_presets.DEFAULT_SIZE[preset]
    return SamplingParams(
        sampler="flow_sde",
        noise_level=0.7,
        num_inference_steps=args.steps,
        num_samples=args.micro_batch_size,
        height=height,
        width=width,
        seed=0,
        lora="policy",
        **({"num_frames": frames} if descriptor.video else {}),
        **descriptor.guidance_fields(False),  # the trainer re-scores without CFG either way
    )


class Peak:
    """The step's peak bytes above its start: the profiler's on the CPU, CUDA's statistics on a GPU."""

    def __init__(self, device: str):
        self.device = device

    @contextlib.contextmanager
    def measure(self) -> Iterator[dict]:
        result: dict = {}
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
            yield result
            torch.cuda.synchronize(self.device)
            result["peak_bytes"] = torch.cuda.max_memory_allocated(self.device) - start
            return
        with AllocationPeak() as peak:
            yield result
        result["peak_bytes"] = peak.peak_bytes


def measure_preset(args: argparse.Namespace, preset: str, report: harness.Report) -> dict:
    dtype = getattr(torch, args.dtype)
    params = sampling_params(args, preset)
    with pipeline(args.family, preset, args.device, dtype) as folder:
        policies = {}
        for mode, checkpointing in MODES.items():
            torch.manual_seed(0)  # the same initial LoRA in both
            policies[mode] = LoraPolicy(
                folder, LORA, device=args.device, dtype=dtype, gradient_checkpointing=checkpointing
            )
        config = EngineConfig(
            model=str(folder), device=args.device, dtype=args.dtype, max_batch_size=args.micro_batch_size
        )
        with RolloutEngine(config) as engine:
            policies["plain"].push(engine)
            prompts = [f"a red square, picture {i}" for i in range(args.prompts)]
            rollout = generate_with_rewards(engine, prompts, params, colour_target)
    optimizers = {mode: torch.optim.AdamW(policy.parameters(), lr=1e-3) for mode, policy in policies.items()}
    # The same rollout again in every round: the later rounds train on samples of an older adapter,
    # which the drift check would refuse; the memory and the time are the same.
    settings = GRPOSettings(
        micro_batch_size=args.micro_batch_size, optimizer_steps=1, kl_beta=0.04, max_log_ratio_before_update=None
    )

    def train(mode: str, round_index: int) -> None:
        generator = torch.Generator().manual_seed(round_index)
        grpo_step(policies[mode], optimizers[mode], rollout, settings, generator)

    def timed(mode: str):
        def run(round_: harness.Round) -> float:
            return harness.timed_call(train, mode, round_.index, device=args.device)[1]

        return run

    # Timed without the profiler (it slows every operator); then one profiled step each for the peak,
    # which is the same in every round.
    samples = harness.run_rounds({mode: timed(mode) for mode in MODES}, args.warmup, args.repeats)
    peak = Peak(args.device)
    for mode in MODES:
        with peak.measure() as measured:
            train(mode, args.warmup + args.repeats)
        samples[mode]["peak_mb"] = measured["peak_bytes"] / 2**20
    plain, checkpointed = (policies[mode].lora_state() for mode in MODES)
    difference = torch.stack([(checkpointed[key] - plain[key]).norm() for key in plain]).norm()
    relative = (difference / torch.stack([tensor.norm() for tensor in plain.values()]).norm()).item()
    parameters = sum(p.numel() for d in policies["plain"].denoisers.values() for p in d.parameters())
    result = {
        mode: {"peak_mb": values["peak_mb"], "s": harness.Stats.of(values["s"]).to_json()}
        for mode, values in samples.items()
    }
    result |= {"lora_relative_difference": relative, "denoiser_parameters": parameters}
    ratio = result["checkpointed"]["peak_mb"] / result["plain"]["peak_mb"]
    report.check(harness.Target(f"{preset}: checkpointed / plain peak", ratio, "<", 1.0))
    report.check(
        harness.Target(f"{preset}: LoRA after the steps, relative difference", relative, "<=", LORA_TOLERANCE)
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    report = harness.Report("train_memory", args, __doc__, argv)
    report.note(
        f"family {args.family}, {args.dtype} on {args.device}; per step {args.prompts} group(s) of "
        f"{args.micro_batch_size} samples x {args.steps} SDE steps, micro-batches of {args.micro_batch_size} "
        f"transitions, LoRA rank {LORA['r']}"
    )
    results = {preset: measure_preset(args, preset, report) for preset in args.presets}
    rows = []
    for preset, result in results.items():
        plain, checkpointed = result["plain"], result["checkpointed"]
        rows.append(
            [
                preset,
                f"{result['denoiser_parameters'] / 1e6:.1f}M",
                plain["peak_mb"],
                checkpointed["peak_mb"],
                checkpointed["peak_mb"] / plain["peak_mb"],
                plain["s"]["median"],
                checkpointed["s"]["median"],
                result["lora_relative_difference"],
            ]
        )
    report.table(
        "one GRPO train step: peak memory above its start, plain vs. gradient checkpointing",
        [
            "preset",
            "denoiser parameters",
            "plain peak MiB",
            "checkpointed peak MiB",
            "ratio",
            "plain s",
            "checkpointed s",
            "LoRA rel. difference",
        ],
        rows,
        note="peak: one profiled step after the timed rounds; seconds: the timed rounds' median, unprofiled. "
        "LoRA rel. difference: |LoRA_checkpointed - LoRA_plain| / |LoRA_plain| over all tensors after every step.",
    )
    report.results = results
    return report.finish()


if __name__ == "__main__":
    main()
