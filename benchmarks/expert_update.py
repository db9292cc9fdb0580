"""Expert update: a full `update_weights` of Wan 2.2's low-noise expert vs. a plain copy of its bytes.

A tiny Wan 2.2 pipeline gets a bigger `transformer_2` (`--preset real`: the published Wan 2.2 A14B expert
config, 14.3B parameters; `--preset small`: four of Wan 2.1 1.3B's blocks, 0.2B parameters, so that on a
CPU the copy, not the per-call overhead, dominates), random weights made on `--device` and saved in
`--dtype`. An engine (executor uni, on `--device`) serves it, the trainer loads the same expert on that
device, and the rounds time, for the same bytes (every tensor of `base_state(trainer's expert)`):

  copy floor  `dst.copy_(src)` for every tensor into tensors allocated beforehand on the device: a
              device-to-device copy, what any push is bounded by;
  engine      `engine.update_weights(state, component="transformer_2")`: the engine's checks,
              staging, apply and commit.

The trainer's copy is perturbed before every engine push; after it (untimed) a few of the engine's tensors
must equal the trainer's, and the other expert's checksum must be unchanged. Reported: medians, GB/s (1e9
bytes) and the engine's time over the copy's. A real run needs a GPU with room for three copies of the
expert (about 86 GB in bfloat16) and about 30 GB of disk for the saved expert:

    python -m benchmarks.expert_update                                   # small, CPU: about 20 s
    python -m benchmarks.expert_update --preset real --device cuda --dtype bfloat16 --repeats 3
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.model_presets import WAN21_T2V_1_3B, WAN22_T2V_A14B_EXPERT
from rollout import EngineConfig, RolloutEngine
from rollout.pipelines.tiny import build_tiny_wan22
from rollout.weights.state import base_state

EXPERT = "transformer_2"
CONFIGS = {"small": WAN21_T2V_1_3B | {"num_layers": 4}, "real": WAN22_T2V_A14B_EXPERT}


def push_rounds(engine: RolloutEngine, state: dict[str, torch.Tensor], args) -> dict[str, dict[str, list[float]]]:
    destination = {name: torch.empty_like(tensor) for name, tensor in state.items()}
    other_checksum = engine.weights_checksum("transformer")

    def copy_all() -> None:
        for name, tensor in state.items():
            destination[name].copy_(tensor)

    def push(round_: harness.Round) -> float:
        with torch.no_grad():
            for tensor in state.values():
                tensor.add_(1e-3)
        _, seconds = harness.timed_call(lambda: engine.update_weights(state, component=EXPERT), device=args.device)
        check_pushed(engine, state)
        if engine.weights_checksum("transformer") != other_checksum:
            raise RuntimeError("pushing transformer_2 changed the other expert")
        return seconds

    modes = {"copy": lambda round_: harness.timed_call(copy_all, device=args.device)[1], "engine": push}
    return harness.run_rounds(modes, args.warmup, args.repeats)


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
    parser = harness.parser("expert_update", __doc__, repeats=5, warmup=1, device="cpu", dtype="float32")
    parser.add_argument("--preset", choices=sorted(CONFIGS), default="small", help="size of the expert pushed")
    parser.add_argument("--folder", type=Path, help="where to build the pipeline (None: a temporary folder)")
    args = parser.parse_args(argv)
    report = harness.Report("expert_update", args, __doc__, argv)
    dtype = getattr(torch, args.dtype)
    from diffusers import WanTransformer3DModel

    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or Path(scratch) / "wan22"
        build_tiny_wan22(folder)
        with torch.device(args.device):  # the pipeline's low-noise expert becomes the preset's
            WanTransformer3DModel(**CONFIGS[args.preset]).to(dtype).save_pretrained(folder / EXPERT)
        with RolloutEngine(EngineConfig(model=str(folder), device=args.device, dtype=args.dtype)) as engine:
            trainer = WanTransformer3DModel.from_pretrained(folder / EXPERT, torch_dtype=dtype).to(args.device)
            state = base_state(trainer)
            state_bytes = sum(t.nbytes for t in state.values())
            parameters = sum(p.numel() for p in trainer.parameters())
            samples = push_rounds(engine, state, args)
    stats = {mode: harness.Stats.of(measured["s"]) for mode, measured in samples.items()}
    ratio = stats["engine"].median / stats["copy"].median
    report.results = {
        "parameters": parameters,
        "bytes": state_bytes,
        **{mode: s.to_json() | {"gb_per_s": state_bytes / 1e9 / s.median} for mode, s in stats.items()},
        "engine_over_copy": ratio,
        "engine_over_copy_per_round": harness.per_round_ratio(samples["engine"]["s"], samples["copy"]["s"]),
    }
    report.table(
        f"{EXPERT}: {parameters / 1e9:.2f}B parameters, {state_bytes / 1e9:.2f} GB in {args.dtype} on {args.device}",
        ["mode", "median s", "min s", "max s", "GB/s"],
        [[mode, s.median, s.min, s.max, state_bytes / 1e9 / s.median] for mode, s in stats.items()],
        note=f"engine update / device copy time: {ratio:.2f}x (medians)",
    )
    return report.finish()


if __name__ == "__main__":
    main()
