"""Bytes per sample that rollout outputs hold, per executor: latents vs. the conditioning.

A trajectory carries its prompt's (and negative prompt's) embeddings so the trainer never re-encodes
text. For SD3.5 at 512x512 those ([333, 4096] float32 each) are four times its latents, so whether the
samples of one prompt share them or each hold a copy decides how much memory a rollout needs.

The pipeline has SD3.5-medium's shapes at 512x512 (16 latent channels, 64x64 latents, text embeddings
[77 + 256, 4096], pooled [2048]) with one-layer random models: the real bytes, little compute. Per sample:

  latents      the trajectory's latents [T+1, 16, 64, 64] float32
  referenced   every distinct tensor storage the outputs reference (shared tensors count once)
  shm held     for "mp": growth of the engine process's resident shared memory (RssShmem) while the
               outputs are alive, i.e. what their shared-memory blocks pin

    python -m benchmarks.output_memory
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
from pathlib import Path

import torch

from benchmarks import harness
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.tiny import TinySD3Sizes, build_tiny_sd3
from rollout.step_series import StepSeries

SHOWN = ("latents", "referenced", "shm_held")  # the table's columns of bytes per sample
SD35_SHAPES = TinySD3Sizes(  # SD3.5-medium's latent and text-embedding shapes at 512x512, one layer of everything
    sample_size=64,
    latent_channels=16,
    num_layers=1,
    num_attention_heads=2,
    attention_head_dim=32,
    text_hidden_size=1024,  # two CLIPs: pooled embeddings of 2048, as CLIP-L + CLIP-G give
    t5_hidden_size=4096,
    text_layers=1,
    vae_block_out_channels=(16, 16),
)


def mib(nbytes: float | None) -> float | str:
    return "-" if nbytes is None else nbytes / 2**20


def tensors_in(value):
    """Every tensor reachable from an output (dataclass fields, lists, dicts, a StepSeries' parts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, StepSeries):  # trajectory latents and records: tree parts shared by leaves
        yield from value.parts
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        yield from tensors_in(list(value.values()))
    elif dataclasses.is_dataclass(value):
        yield from tensors_in([getattr(value, field.name) for field in dataclasses.fields(value)])


def referenced_bytes(outputs) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors_in(outputs)}
    return sum(storages.values())


def rss_shmem_bytes() -> int:
    lines = Path("/proc/self/status").read_text().splitlines()
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("RssShmem:")), 0)


def measure(model: str, executor: str, args) -> dict:
    workers = args.mp_workers if executor == "mp" else 1
    config = EngineConfig(model=model, executor=executor, num_workers=workers, max_batch_size=args.group_size)
    params = SamplingParams(num_inference_steps=args.steps, guidance_scale=4.5, num_samples=args.group_size, seed=0)
    prompts = [f"prompt number {i}" for i in range(args.prompts)]
    with RolloutEngine(config) as engine:
        engine.generate(prompts[:1], SamplingParams(num_inference_steps=1, seed=0))  # warm up
        gc.collect()
        shm_before = rss_shmem_bytes()
        outputs = engine.generate(prompts, params)
        shm_held = rss_shmem_bytes() - shm_before
        result = {
            "samples": len(outputs),
            "latents_per_sample": outputs[0].trajectory.latents.nbytes,
            "referenced_per_sample": referenced_bytes(outputs) / len(outputs),
            "shm_held_per_sample": shm_held / len(outputs) if executor == "mp" else None,
        }
        del outputs  # before the engine shuts down
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser("output_memory", __doc__)
    parser.add_argument("--prompts", type=harness.positive_int, default=2, help="distinct prompts per rollout")
    parser.add_argument("--group-size", type=harness.positive_int, default=8, help="samples per prompt (num_samples)")
    parser.add_argument("--steps", type=harness.positive_int, default=10, help="denoising steps (trajectory length)")
    parser.add_argument("--executors", default="uni,mp", help="comma-separated executors to measure")
    parser.add_argument("--mp-workers", type=harness.positive_int, default=2, help="mp executor: worker processes")
    args = parser.parse_args(argv)
    report = harness.Report("output_memory", args, __doc__, argv)
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as folder:
        build_tiny_sd3(folder, seed=0, sizes=SD35_SHAPES)
        report.results = {executor: measure(folder, executor, args) for executor in args.executors.split(",")}
    report.table(
        f"bytes per sample: {args.prompts} prompts x {args.group_size} samples, {args.steps} steps, CFG on; "
        "SD3.5 shapes at 512x512",
        ["executor", "latents MiB", "referenced MiB", "shm held MiB"],
        [[executor, *(mib(row[f"{kind}_per_sample"]) for kind in SHOWN)] for executor, row in report.results.items()],
    )
    return report.finish()


if __name__ == "__main__":
    main()
