"""How close the memory plan's activation estimate comes to measured peaks on this CPU:
`python -m benchmarks.memory_plan_check [--rows N]`.

For the tiny and the small SD3 pipelines, one GRPO micro-batch (forward and backward of `rows`
transitions with CFG's unconditional rows, LoRA rank 8 on the attention projections), gradient
checkpointing off and on, three figures: the plan's estimate (meta modules, fake tensors), the same
count on the real model (`LiveTensorBytes`: bytes of live tensor storage), and torch's profiler's
allocation high-water mark of the CPU allocator over the same call (`AllocationPeak`, which also
sees what kernels allocate inside themselves and the prompt encoding before the step).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from benchmarks.allocation_peak import AllocationPeak
from benchmarks.model_presets import build
from recipes.memory_plan import meta_adapter
from rollout import SamplingParams
from rollout.pipelines.families import family_named
from rollout.pipelines.loading import load_adapter
from trainers_adapters.policy.train_step_peak import attach_lora, train_step_peak

LORA = {"r": 8, "lora_alpha": 16}
PARAMS = SamplingParams(sampler="flow_sde", noise_level=0.7, guidance_scale=4.5)


def peaks(folder: str, rows: int, checkpointing: bool) -> dict[str, int]:
    """The estimate and the two measured peaks (bytes) of one micro-batch of the model in `folder`."""
    figures = {}
    for name, adapter, fake in (
        ("estimate", meta_adapter(folder, torch.float32), True),
        ("live_tensors", load_adapter(folder), False),
    ):
        attach_lora(adapter, LORA)
        if checkpointing:
            adapter.transformer.enable_gradient_checkpointing()
        if fake:
            figures[name] = train_step_peak(adapter, PARAMS, rows, guided=True, fake=True)
            continue
        with AllocationPeak() as allocator:
            figures[name] = train_step_peak(adapter, PARAMS, rows, guided=True, fake=False)
        figures["allocator"] = allocator.peak_bytes
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_plan_check", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4, help="transitions per micro-batch (CFG doubles the rows run)")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        folders = {
            "tiny": str(family_named("sd3").build_tiny(f"{scratch}/tiny", seed=0)),
            "small": str(build("sd3", "small", f"{scratch}/small", "cpu", torch.float32)),
        }
        for preset, folder in folders.items():
            for checkpointing in (False, True):
                figures = peaks(folder, args.rows, checkpointing)
                key = f"{preset} checkpointing={'on' if checkpointing else 'off'}"
                results[key] = figures
                ratios = ", ".join(
                    f"{name} {figures[name] / 2**20:.2f} MiB (estimate/this {figures['estimate'] / figures[name]:.3f})"
                    for name in ("live_tensors", "allocator")
                )
                print(f"{key}: estimate {figures['estimate'] / 2**20:.2f} MiB; {ratios}")
    return results


if __name__ == "__main__":
    main()
