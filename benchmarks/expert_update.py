"""Expert update: a full `update_weights` of Wan 2.2's low-noise expert vs. a plain copy of its bytes.

Builds a tiny Wan 2.2 pipeline whose `transformer_2` is replaced by a bigger expert (`--preset real`:
the published Wan 2.2 A14B expert config, 14.3B parameters, random weights, made on the device and
saved in `--dtype`; `--preset small`: four of Wan 2.1 1.3B's blocks, 0.2B parameters), starts an
engine on it (executor uni, on `--device`), loads the same expert a second time as the trainer's
copy on the same device, and measures, for the same bytes (every tensor of `base_state(trainer's expert)`):

  copy floor  `dst.copy_(src)` for every tensor into tensors allocated beforehand on the device: a
              device-to-device copy, what any push is bounded by;
  engine      `engine.update_weights(state, component="transformer_2")`: the engine's checks,
              staging, apply and commit.

Before every round the trainer's copy is perturbed (so every push changes the weights). After each
engine push (untimed) a few of the engine's tensors are compared with the trainer's, and the other
expert's checksum must be unchanged. Rounds are interleaved, warmup rounds discarded, medians
reported with GB/s (1e9 bytes) and the engine's time over the copy's.

A real run needs a GPU with room for three copies of the expert (about 86 GB in bfloat16) and about
30 GB of disk for the saved expert:

    python -m benchmarks.expert_update                                   # small, CPU: about 20 s
    python -m benchmarks.expert_update --preset real --device cuda --dtype bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import interleaved_rounds, json_args, synchronize, write_json
from benchmarks.model_presets import WAN21_T2V_1_3B, WAN22_T2V_A14B_EXPERT
from rollout import EngineConfig, RolloutEngine
from rollout.pipelines.tiny import build_tiny_wan22
from rollout.weights import base_state

logger = logging.getLogger(__name__)

EXPERT = "transformer_2"
# small: Wan 2.1 1.3B's blocks, 4 of them (about 0.2B parameters, 0.8 GB in float32): big enough
# that the copy, not the per-call overhead, dominates on a CPU.
CONFIGS = {"small": WAN21_T2V_1_3B | {"num_layers": 4}, "real": WAN22_T2V_A14B_EXPERT}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.expert_update", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(CONFIGS), default="small", help="size of the expert pushed")
    parser.add_argument("--device", default="cpu", help="where the engine, the trainer's copy and the copy live")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the expert's dtype")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; each runs both modes")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--folder", type=Path, help="where to build the pipeline (default: a temporary folder)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    return parser.parse_args(argv)


def build_pipeline(folder: Path, preset: str, device: str, dtype: torch.dtype) -> Path:
    """A tiny Wan 2.2 pipeline whose low-noise expert is the preset's (made on `device`)."""
    from diffusers import WanTransformer3DModel

    build_tiny_wan22(folder)
    with torch.device(device):
        expert = WanTransformer3DModel(**CONFIGS[preset]).to(dtype)
    expert.save_pretrained(folder / EXPERT)
    del expert
    return folder


def push_rounds(engine: RolloutEngine, trainer: torch.nn.Module, args) -> dict[str, list[float]]:
    state = base_state(trainer)
    destination = {name: torch.empty_like(tensor) for name, tensor in state.items()}
    other_checksum = engine.weights_checksum("transformer")
    seconds: dict[str, list[float]] = {"copy": [], "engine": []}
    for round_ in interleaved_rounds(("copy", "engine"), args.warmup, args.repeats):
        with torch.no_grad():
            for tensor in state.values():
                tensor.add_(1e-3)  # every push changes the weights
        for mode in round_.order:
            synchronize(args.device)
            start = time.perf_counter()
            if mode == "copy":
                for name, tensor in state.items():
                    destination[name].copy_(tensor)
            else:
                engine.update_weights(state, component=EXPERT)
            synchronize(args.device)
            elapsed = time.perf_counter() - start
            if round_.timed:
                seconds[mode].append(elapsed)
            logger.info("  [%s] %-6s %8.3f s", round_.tag, mode, elapsed)
        check_pushed(engine, state)
        if engine.weights_checksum("transformer") != other_checksum:
            raise RuntimeError("pushing transformer_2 changed the other expert")
    return seconds


def check_pushed(engine: RolloutEngine, state: dict[str, torch.Tensor]) -> None:
    """A few of the engine's tensors must equal the trainer's after a push."""
    names = sorted(state)[:: max(1, len(state) // 5)]

    def read(worker, names):
        engine_state = base_state(worker.adapter.components[EXPERT])
        return [engine_state[name].float().sum().item() for name in names]

    got = engine.collective_rpc(read, args=(names,))[0]
    want = [state[name].float().sum().item() for name in names]
    if got != want:
        raise RuntimeError(f"the engine's {EXPERT} does not hold the pushed tensors: {got} != {want}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as scratch:
        folder = build_pipeline(args.folder or Path(scratch) / "wan22", args.preset, args.device, dtype)
        config = EngineConfig(model=str(folder), device=args.device, dtype=args.dtype)
        with RolloutEngine(config) as engine:
            from diffusers import WanTransformer3DModel

            trainer = WanTransformer3DModel.from_pretrained(folder / EXPERT, torch_dtype=dtype).to(args.device)
            state_bytes = sum(t.nbytes for t in base_state(trainer).values())
            parameters = sum(p.numel() for p in trainer.parameters())
            seconds = push_rounds(engine, trainer, args)
    result = {"args": json_args(args), "parameters": parameters, "bytes": state_bytes}
    print(
        f"\n{EXPERT}: {parameters / 1e9:.2f}B parameters, {state_bytes / 1e9:.2f} GB in {args.dtype} on {args.device}"
    )
    print(f"{'mode':<8} {'median s':>9} {'min s':>8} {'GB/s':>8}")
    for mode, values in seconds.items():
        median = statistics.median(values)
        result[mode] = {"median_s": median, "min_s": min(values), "gb_per_s": state_bytes / 1e9 / median}
        print(f"{mode:<8} {median:>9.3f} {min(values):>8.3f} {state_bytes / 1e9 / median:>8.2f}")
    ratio = result["engine"]["median_s"] / result["copy"]["median_s"]
    result["engine_over_copy"] = ratio
    print(f"engine update / device copy time: {ratio:.2f}x")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
