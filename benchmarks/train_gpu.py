"""Two training steps of the real-size LoRA recipes on one GPU, against their memory plan.

`make train-gpu` runs it: for SD3.5 Medium (recipes/configs/grpo_sd35_medium_lora.yaml) and
FLUX.1-dev (grpo_flux1_dev_lora.yaml), it builds the family's `--preset` pipeline (`real`: the
published transformer config with random weights, one-layer text encoders and a narrow VAE; nothing
is downloaded) in a scratch folder, runs the recipe itself (`recipes.run`'s config check and
`run`) for 2 steps of one group each (the config's group size and every other setting kept; one
group, not Flow-GRPO's 48, so a step fits a few minutes), then reports per recipe:

  the peak memory of the run (`torch.cuda.max_memory_allocated`; on a CPU none is measured) beside
  the memory plan of the same folder (`python -m recipes.run CONFIG --plan`: its weights are the
  built folder's, stand-ins included, so the two count the same model) and the plan of the
  published model (the weights of the real text encoders and VAE);
  the step split from metrics.jsonl: rollout_s, reward_wait_s, update_s, push_s.

The plan counts the weights, the LoRA and its AdamW states and one training micro-batch's
activations, not the engine's sampling activations (no gradients; `engine.max_batch_size` bounds
them), so a measured peak above the plan's total is the rollout's. Checked here on a CPU with the
small preset:

    python -m benchmarks.train_gpu --preset small --device cpu --dtype float32 --num-samples 4
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.model_presets import DEFAULT_SIZE, build
from recipes.loading import load_config, recipe_module
from recipes.memory_plan import GIB, memory_plan

# Recipe -> the family whose preset it trains; each config's own settings otherwise.
RECIPES = {
    "grpo_sd35_medium_lora": "sd3",
    "grpo_flux1_dev_lora": "flux",
}
STEPS = 2
SPLIT = ("rollout_s", "reward_wait_s", "update_s", "push_s")


def parse_args(argv: list[str] | None = None):
    parser = harness.parser("train_gpu", __doc__, device="cuda", dtype="bfloat16")
    parser.add_argument("--preset", choices=("small", "real"), default="real", help="the pipelines' sizes")
    parser.add_argument("--only", nargs="+", choices=sorted(RECIPES), help="these recipes only")
    parser.add_argument(
        "--num-samples", type=harness.positive_int, help="the group size (sampling.num_samples); None: the config's"
    )
    parser.add_argument("--scratch", type=Path, help="where pipelines and outputs go (a temporary folder)")
    return parser.parse_args(argv)


def overrides(args, folder: Path, output_dir: Path) -> list[str]:
    """The --set lines that run a recipe's config on the built pipeline for `STEPS` steps of one group."""
    size = DEFAULT_SIZE[args.preset]
    lines = [
        f"model.path={folder}",
        f"engine.device={args.device}",
        f"engine.dtype={args.dtype}",
        f"sampling.height={size}",
        f"sampling.width={size}",
        "prompts_per_step=1",
        f"steps={STEPS}",
        f"output_dir={output_dir}",
        "checkpoint_every=0",
        "resume=null",
        "logger=jsonl",
        "eval.num_prompts=1",
        "eval.num_samples=1",
        "eval.num_inference_steps=2",
    ]
    if args.num_samples is not None:
        lines.append(f"sampling.num_samples={args.num_samples}")
    if args.preset == "small":  # the small transformer is made for 64x64, the plan's 80 GiB says nothing there
        lines.append("trainer.device_memory_gib=null")
    return lines


def run_recipe(name: str, family: str, args, scratch: Path) -> dict:
    """Build `family`'s preset, run recipe config `name` on it, and measure; the folder is removed after."""
    folder = scratch / family
    config_path = f"recipes/configs/{name}.yaml"
    started = time.perf_counter()
    build(family, args.preset, folder, args.device, getattr(torch, args.dtype))
    build_s = time.perf_counter() - started
    output_dir = scratch / f"out_{name}"
    config = load_config(config_path, overrides(args, folder, output_dir), on_this_machine=True)
    plan = memory_plan(config)
    published = memory_plan(load_config(config_path, [f"engine.dtype={args.dtype}"]))
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    recipe_module(config.recipe).run(config)
    run_s = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else None
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    shutil.rmtree(folder, ignore_errors=True)  # room for the next family's
    return {
        "build_s": build_s,
        "run_s": run_s,
        "peak_bytes": peak,
        "plan_bytes": max(device.total for device in plan.devices),
        "published_plan_bytes": max(device.total for device in published.devices),
        "steps": [{key: record[key] for key in ("step", *SPLIT)} for record in records],
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = harness.Report("train_gpu", args, __doc__, argv)
    chosen = [name for name in RECIPES if args.only is None or name in args.only]
    scratch = Path(tempfile.mkdtemp(prefix="rollout-train-gpu-", dir=args.scratch))
    results = {}
    try:
        for name in chosen:
            print(f"{name}: building the {args.preset} {RECIPES[name]} pipeline, then {STEPS} steps", flush=True)
            results[name] = run_recipe(name, RECIPES[name], args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def gib(count: int | None) -> str:
        return "not measured" if count is None else f"{count / GIB:.2f}"

    report.table(
        "memory (GiB)",
        ["recipe", "measured peak", "plan of the built folder", "plan of the published model"],
        [[n, gib(r["peak_bytes"]), gib(r["plan_bytes"]), gib(r["published_plan_bytes"])] for n, r in results.items()],
        note="measured: torch.cuda.max_memory_allocated over the run (engine, trainer, rollouts); the plan leaves "
        "out the rollouts' own activations",
    )
    report.table(
        "step split (s)",
        ["recipe", "step", *SPLIT],
        [[n, s["step"], *(s[key] for key in SPLIT)] for n, r in results.items() for s in r["steps"]],
        note="from each run's metrics.jsonl",
    )
    report.table("time (s)", ["recipe", "build", "run"], [[n, r["build_s"], r["run_s"]] for n, r in results.items()])
    report.results = results
    return report.finish()


if __name__ == "__main__":
    main()
