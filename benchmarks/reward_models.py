"""Reward models: the library's CLIP score vs. the same computation written directly with
transformers, and what a weighted sum with its output checks adds.

Scores one batch of `--batch` random uint8 images (`--size` px) against their prompts, modes side
by side in each round:

  direct transformers     processor, `get_image_features` / `get_text_features`, 100 * cosine,
                          clipped at 0, under `torch.no_grad`: the baseline, without the library;
  ClipScore               `ClipScore(model)(images, prompts, metadata)`;
  composite + checks      `CompositeReward([clip_score]).score(...)`: the component's output checked
                          (one finite float32 per sample), the weighted sum and its check;
  ClipScore batch 1       `ClipScore(model, batch_size=1)`: one forward per image.

The scores of every mode are compared (untimed) with the baseline's, within 1e-5. Targets: the
class and the composite each within 5% of the direct computation's time.

    python -m benchmarks.reward_models                       # the tiny random CLIP (32 px), 1 thread
    python -m benchmarks.reward_models --model /models/clip-vit-large-patch14 --device cuda
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from benchmarks import harness
from trainers_adapters.rewards.composite import CompositeReward, RewardComponent
from trainers_adapters.rewards.models import ClipScore
from trainers_adapters.rewards.models.tiny import build_tiny_clip

MODES = {
    "direct": "direct transformers (baseline)",
    "class": "ClipScore",
    "composite": "composite + checks",
    "one_by_one": "ClipScore batch 1",
}
TARGET_OVERHEAD = 1.05


def build_parser():
    parser = harness.parser("reward_models", __doc__, repeats=40, warmup=2, threads=1, device="cpu", model=None)
    run = parser.add_argument_group("what to run")
    run.add_argument("--batch", type=harness.positive_int, default=16, help="images scored per call")
    run.add_argument("--size", type=harness.positive_int, default=64, help="height and width of the images")
    return parser


def direct_clip_score(model, processor, images, prompts, device) -> torch.Tensor:
    with torch.no_grad():
        pixels = processor(images=list(images), return_tensors="pt", padding=True)["pixel_values"].to(device)
        tokens = processor(text=prompts, return_tensors="pt", padding=True)
        image = model.get_image_features(pixel_values=pixels).pooler_output
        text = model.get_text_features(
            input_ids=tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device)
        ).pooler_output
        image, text = image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)
        return (100 * (image * text).sum(-1)).clamp(min=0).cpu()


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            folder = str(args.model) if args.model is not None else str(build_tiny_clip(Path(scratch) / "clip"))
            return _measure(args, argv, folder)
    finally:
        torch.set_num_threads(previous_threads)


def _measure(args, argv, folder: str) -> dict:
    from transformers import CLIPModel, CLIPProcessor

    report = harness.Report("reward_models", args, __doc__, argv)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.batch, 3, args.size, args.size), dtype=torch.uint8, generator=generator)
    prompts = [f"a photo of thing number {index}" for index in range(args.batch)]
    metadata = [{"prompt_index": index // 4, "sample_index": index % 4} for index in range(args.batch)]
    model = CLIPModel.from_pretrained(folder).eval().to(args.device)
    processor = CLIPProcessor.from_pretrained(folder, backend="pil")
    reward = ClipScore(folder, device=args.device, batch_size=args.batch)
    one_by_one = ClipScore(folder, device=args.device, batch_size=1)
    composite = CompositeReward([RewardComponent("clip_score", reward)])
    calls = {
        "direct": lambda: direct_clip_score(model, processor, images, prompts, args.device),
        "class": lambda: reward(images, prompts, metadata),
        "composite": lambda: composite.score(images, prompts, metadata).total,
        "one_by_one": lambda: one_by_one(images, prompts, metadata),
    }
    expected = calls["direct"]()
    for mode, call in calls.items():  # untimed: every mode computes the baseline's scores
        difference = (call() - expected).abs().max().item()
        if difference > 1e-5:
            raise AssertionError(f"{MODES[mode]} differs from the direct computation by {difference:.2e}")

    def timed(mode):
        return lambda round_: harness.timed_call(calls[mode], device=args.device)[1]

    times = harness.run_rounds({mode: timed(mode) for mode in calls}, args.warmup, args.repeats)
    seconds = {mode: times[mode]["s"] for mode in calls}
    rows = []
    for mode in calls:
        stats = harness.Stats.of(seconds[mode], 1e3)
        ratio = harness.per_round_ratio(seconds[mode], seconds["direct"])
        rows.append([MODES[mode], stats.median, stats.percentile(90), args.batch / (stats.median / 1e3), ratio])
        report.results[mode] = {"ms": stats, "vs_direct": ratio}
    report.table(
        f"CLIP score of {args.batch} images of {args.size} px",
        ["mode", "median ms", "p90 ms", "images/s", "time / direct"],
        rows,
        note="time / direct: the median over rounds of each round's ratio",
    )
    for mode in ("class", "composite"):
        report.check(
            harness.Target(f"{MODES[mode]} time / direct", report.results[mode]["vs_direct"], "<=", TARGET_OVERHEAD)
        )
    return report.finish()


if __name__ == "__main__":
    main()
