"""Sequence and CFG parallel layouts at real size: FLOPs, all-to-all bytes and the speedup on 8 GPUs.

`--mode cost` (the default): a cost model, nothing runs on a GPU. The
published transformers of Wan 2.1 T2V 14B (480x832, 81 frames), Qwen-Image (1024x1024) and
FLUX.1-dev (1024x1024) are built on the meta device; torch's FlopCounterMode counts one forward
(cross-checked against 2·params·tokens + 4·L·S²·d); `benchmarks/parallel_cost.py` turns the counts
into a step's time under every layout d x c x u x r of `--gpus` GPUs (data replicas, CFG parallel,
Ulysses and ring degrees) at `--mfu` of `--peak-tflops`, with all-to-all and ring bytes at
`--link-gbs`. It prints each layout's latency and node throughput against `--gpus` x data
parallel, the layout it picks for RL rollouts and why, and its prediction for vLLM-Omni's quoted
Qwen-Image measurement (2048x2048, 50 steps, H800: 112.5 s on one GPU, 65.2 / 39.6 / 30.8 s with
Ulysses 2 / 4 / 8) next to those numbers.

`--mode measure`: the layouts measured on CPU processes (`benchmarks/parallel_measure.py`): the
per-step time of one worker against a group of Ulysses 2 with the same total threads, and the
bytes each layout's collectives send a step, counted inside the workers and checked against the
cost model's all-to-all formula.

    python -m benchmarks.parallel                        # about 30 s of CPU, no memory to speak of
    python -m benchmarks.parallel --mfu 0.5 --link-gbs 450 --gpu-memory-gb 141
    python -m benchmarks.parallel --mode measure         # a few minutes of 2 CPU cores
"""

from __future__ import annotations

import argparse
import dataclasses

from benchmarks import harness, parallel_measure
from benchmarks.parallel_cases import Counted, count, flux1_dev, qwen_image, wan21_14b
from benchmarks.parallel_cost import (
    Hardware,
    Layout,
    ModelCost,
    StepCost,
    analytic_attention_flops,
    analytic_linear_flops,
    layouts,
    pick,
    step_cost,
)
from benchmarks.parallel_measure import add_arguments, measure_mode

GB = 1e9

# vLLM-Omni's quoted Qwen-Image measurement: 2048x2048, 50 steps, H800s; seconds per image by
# Ulysses degree.
VLLM_OMNI_QWEN_IMAGE_2048 = {1: 112.5, 2: 65.2, 4: 39.6, 8: 30.8}
H800_LINK_GBS = 400  # H800's NVLink: 400 GB/s per GPU (H100's 900 cut down)


def hardware(args: argparse.Namespace, **changes) -> Hardware:
    base = Hardware(
        peak_flops=args.peak_tflops * 1e12,
        mfu=args.mfu,
        link_bytes_per_s=args.link_gbs * GB,
        collective_latency_s=args.latency_us * 1e-6,
        memory_bytes=args.gpu_memory_gb * GB,
    )
    return dataclasses.replace(base, **changes)


def flops_table(report: harness.Report, counted: list[Counted]) -> None:
    rows = []
    for item in counted:
        case, flops = item.case, item.flops
        linear = analytic_linear_flops(item.parameters, case.sequence)
        attention = analytic_attention_flops(case.attention_layers, case.width, case.sequence, case.sequence)
        if not case.joint:  # Wan: cross-attention of every token over the text
            attention += analytic_attention_flops(case.attention_layers, case.width, case.sequence, case.text_tokens)
        rows.append(
            [
                case.name,
                case.size,
                f"{case.image_tokens}+{case.text_tokens}" + ("" if case.joint else " (cross)"),
                item.parameters / 1e9,
                case.published_billions,
                flops.total / 1e12,
                flops.linear / 1e12,
                linear / 1e12,
                flops.attention / 1e12,
                attention / 1e12,
                flops.total / (linear + attention),
            ]
        )
        report.check(
            harness.Target(
                f"{case.name} parameters / published", item.parameters / 1e9 / case.published_billions, "<=", 1.02
            )
        )
        report.check(
            harness.Target(f"{case.name} counted / analytic attention", flops.attention / attention, "<=", 1.01)
        )
    report.table(
        "FLOPs of one transformer forward, one sample (FlopCounterMode on the meta device; TFLOP = 1e12)",
        [
            "model",
            "size",
            "tokens image+text",
            "params B",
            "published B",
            "counted TFLOP",
            "counted linear",
            "2·P·S",
            "counted attention",
            "4·L·S²·d",
            "counted / analytic",
        ],
        rows,
        note="2·P·S counts every weight against every token: it overshoots the linear layers because adaLN "
        "modulation weights (a quarter of FLUX.1's) see one timestep vector and a dual-stream block's weights "
        "see only their stream's tokens (FLUX.1's 19 double blocks, all of Qwen-Image's 60), and Wan's cross-"
        "attention K/V see 512 text tokens. Attention agrees with 4·L·S²·d (Wan: plus 4·L·S·512·d across).",
    )


def layout_rows(costs: list[StepCost], dp: StepCost, picked: StepCost | None, steps: int, memory: float) -> list:
    rows = []
    for cost in costs:
        rows.append(
            [
                str(cost.layout),
                cost.layout.per_sample,
                1e3 * cost.compute_s,
                cost.sent_bytes / 1e6,
                1e3 * cost.ulysses_s,
                1e3 * cost.ring_exposed_s,
                1e3 * cost.cfg_s,
                1e3 * cost.step_s,
                dp.step_s / cost.step_s,
                cost.samples_per_s / dp.samples_per_s,
                cost.samples_per_s / steps,
                cost.memory_bytes / GB,
                "yes" if cost.memory_bytes <= memory else "NO",
                "<-" if cost is picked else "",
            ]
        )
    return rows


LAYOUT_COLUMNS = [
    "layout",
    "GPUs/sample",
    "compute ms",
    "sent MB/rank",
    "Ulysses ms",
    "ring ms",
    "CFG ms",
    "step ms",
    "latency x",
    "throughput x",
    "samples/s/node",
    "GB/GPU",
    "fits",
    "pick",
]


def why(model: ModelCost, picked: StepCost | None, dp: StepCost, costs: list[StepCost], hw: Hardware) -> str:
    """The pick, said in words from its numbers."""
    if picked is None:
        return f"{model.name}: no layout fits in {hw.memory_bytes / GB:.0f} GB: the weights need sharding (FSDP or TP)"
    best = max(cost.samples_per_s for cost in costs if cost.memory_bytes <= hw.memory_bytes)
    lost = 1 - picked.samples_per_s / best
    fastest = min(costs, key=lambda cost: cost.step_s)
    parts = [f"{model.name}: {picked.layout}"]
    if dp.memory_bytes > hw.memory_bytes:
        parts.append(f"one GPU cannot hold a sample ({dp.memory_bytes / GB:.0f} GB > {hw.memory_bytes / GB:.0f} GB)")
    else:
        parts.append(
            f"one GPU holds a sample ({dp.memory_bytes / GB:.0f} of {hw.memory_bytes / GB:.0f} GB), so only "
            "throughput decides, and a split's traffic costs throughput"
        )
    splits = [cost for cost in costs if cost.layout.per_sample > 1]
    if picked.layout.per_sample == 1 and splits:
        split = max(splits, key=lambda cost: cost.samples_per_s)
        parts.append(f"the cheapest split, {split.layout}, gives up {100 * (1 - split.samples_per_s / best):.2f}%")
    elif picked.layout.cfg > 1 and picked.layout.sequence_split == 1:
        parts.append(
            f"CFG parallel runs the two passes on two GPUs for one velocity exchange a step "
            f"({1e3 * picked.cfg_s:.3f} ms): {100 * lost:.3f}% below the best throughput at "
            f"{dp.step_s / picked.step_s:.2f}x lower latency"
        )
    elif picked.layout.per_sample > 1:
        parts.append(f"{100 * lost:.2f}% below the best throughput at {dp.step_s / picked.step_s:.2f}x lower latency")
    parts.append(
        f"the fastest per sample, {fastest.layout}, has {dp.step_s / fastest.step_s:.2f}x lower latency for "
        f"{100 * (1 - fastest.samples_per_s / best):.1f}% less throughput"
    )
    return "; ".join(parts)


def vllm_omni_check(report: harness.Report, args: argparse.Namespace, modules: dict) -> None:
    counted = count(qwen_image(2048, 2048, args.qwen_prompt_tokens), modules)
    steps, measured, peak = 50, VLLM_OMNI_QWEN_IMAGE_2048, args.peak_tflops * 1e12
    # Each reading of the quoted run (one pass a step, or true CFG's two) with the MFU that makes one
    # GPU take the measured time, all of it counted as transformer work.
    readings = {}
    for passes in (1, 2):
        model = dataclasses.replace(counted.model_cost(), passes=passes)
        mfu = steps * passes * model.flops_per_forward / (peak * measured[1])
        hw = hardware(args, mfu=mfu, link_bytes_per_s=H800_LINK_GBS * GB)
        predicted = {u: steps * step_cost(model, Layout(data=1, ulysses=u), hw).step_s for u in measured}
        readings[passes] = (mfu, predicted)
    # Amdahl from the 1- and 2-GPU times: a part that does not split, and one that splits by u.
    serial = 2 * measured[2] - measured[1]
    parallel = measured[1] - serial
    rows = [
        [u, seconds, measured[1] / seconds]
        + [readings[passes][1][u] for passes in (1, 2)]
        + [measured[1] / readings[2][1][u], serial + parallel / u]
        for u, seconds in measured.items()
    ]
    (mfu_1, _), (mfu_2, cfg) = readings[1], readings[2]
    off = max(abs(serial + parallel / u - measured[u]) / measured[u] for u in (4, 8))
    report.table(
        "vLLM-Omni's Qwen-Image measurement (2048x2048, 50 steps, H800) vs. this model",
        [
            "Ulysses",
            "measured s",
            "measured speedup",
            f"model s, 1 pass (MFU {mfu_1:.2f})",
            f"model s, CFG (MFU {mfu_2:.2f})",
            "model speedup, CFG",
            f"{serial:.1f} + {parallel:.1f}/u s",
        ],
        rows,
        note=f"The model: {counted.case.sequence} tokens ({counted.flops.total / 1e12:.0f} TFLOP a forward), for "
        "each reading of the run (one pass a step, or true CFG's two: the quote does not say) the MFU that makes "
        f"one GPU take 112.5 s, and H800's {H800_LINK_GBS} GB/s NVLink. It predicts near-linear speedups; the "
        f"measured ones fall short. The last column fits the 1- and 2-GPU times with a part that does not split: "
        f"{serial:.1f} s ({100 * serial / measured[1]:.0f}% of one GPU's time) reproduces the measured 4 and 8 "
        f"within {100 * off:.0f}%, while the model's all-to-all adds {cfg[8] - measured[1] / 8:.1f} s at u=8. "
        "What the model misses is work that does not split (text encoding, the VAE decode of 2048x2048, per-step "
        "overheads) and the lower MFU of smaller per-GPU shapes, not communication.",
    )
    report.results["vllm_omni_qwen_image_2048"] = {
        "mfu_fit_1_pass": mfu_1,
        "mfu_fit_cfg": mfu_2,
        "serial_s": serial,
        "rows": rows,
    }


def cost_mode(report: harness.Report, args: argparse.Namespace) -> None:
    modules: dict = {}
    cases = [
        wan21_14b(),
        qwen_image(prompt_tokens=args.qwen_prompt_tokens),
        flux1_dev(true_cfg=args.flux_true_cfg),
    ]
    counted = [count(case, modules) for case in cases]
    flops_table(report, counted)
    hw = hardware(args)
    slow_links = hardware(args, link_bytes_per_s=args.link_gbs * GB / 2)
    decisions = []
    for item in counted:
        model = item.model_cost()
        costs = [
            step_cost(model, layout, hw, args.ring_overlap) for layout in layouts(args.gpus, model.heads, model.passes)
        ]
        dp = costs[0]
        picked = pick(costs, hw.memory_bytes, args.tie)
        report.table(
            f"{model.name} {item.case.size}, {item.case.cfg_note}, {model.sequence} tokens: one step of one sample "
            f"on {args.gpus} GPUs",
            LAYOUT_COLUMNS,
            layout_rows(costs, dp, picked, args.steps, hw.memory_bytes),
        )
        halved = [step_cost(model, cost.layout, slow_links, args.ring_overlap) for cost in costs]
        halved_pick = pick(halved, hw.memory_bytes, args.tie)
        same = halved_pick is not None and picked is not None and halved_pick.layout == picked.layout
        decisions.append(
            [model.name, str(picked.layout) if picked else "none", "same" if same else str(halved_pick.layout)]
        )
        report.note(why(model, picked, dp, costs, hw))
        report.results[model.name] = {
            "flops_per_forward": item.flops.total,
            "parameters": item.parameters,
            "picked": str(picked.layout) if picked else None,
            "layouts": {
                str(c.layout): {"step_s": c.step_s, "sent_bytes": c.sent_bytes, "memory_bytes": c.memory_bytes}
                for c in costs
            },
        }
    report.table(
        f"picks on {args.gpus} GPUs",
        ["model", "picked layout", f"at {args.link_gbs / 2:g} GB/s links"],
        decisions,
    )
    vllm_omni_check(report, args, modules)
    for line in assumptions(args):
        report.note(line)


def assumptions(args: argparse.Namespace) -> list[str]:
    return [
        f"Assumed: {args.peak_tflops:g} TFLOP/s bf16 dense per GPU (H100/H800) at MFU {args.mfu:g} for every layout "
        "(smaller per-GPU shapes under a split may reach less; the vLLM-Omni check shows how much that matters).",
        f"Assumed: each rank's sent bytes move at {args.link_gbs:g} GB/s (NVSwitch is non-blocking, so an all-to-all "
        "is bound by each GPU's link, not by bisection; H100's 900 GB/s is both directions together, pass "
        f"--link-gbs 450 for one direction) plus {args.latency_us:g} µs per collective or ring pass; "
        "bf16 activations.",
        "Ulysses: 4 all-to-alls per attention layer (Q, K, V, output), 4·S·H·D·b·(u-1)/u² bytes per rank, not "
        "overlapped; with ring as well, S is the ring's share S/r. Wan's cross-attention needs none (each rank "
        "keeps the 512 text tokens' K/V).",
        "Ring: r-1 K/V blocks per attention layer reach every rank, "
        + (
            "passed around a ring overlapped with the block in hand's attention; only the rest is exposed. "
            if args.ring_overlap
            else "all-gathered before the attention and not overlapped (diffusers' ring attention; "
            "--ring-overlap for a P2P ring that hides behind each block's attention). "
        )
        + "CFG parallel: one velocity exchange per step. Data parallel: no per-step traffic.",
        f"Throughput: samples/s over the node at {args.steps} steps a sample; latency x and throughput x are against "
        f"{args.gpus} x data parallel. Memory per GPU: transformer, text encoders and VAE in bf16 (none of these "
        "layouts shards weights) plus one block's transient activations, (6·d + ffn)·2 bytes per token on the GPU, "
        f"against {args.gpu_memory_gb:g} GB (the VAE decode's peak not counted).",
        f"Pick: the highest throughput that fits; among layouts within {100 * args.tie:g}% of it, the lowest latency.",
    ]


MODES = {"cost": cost_mode, "measure": measure_mode}


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser("parallel", __doc__, repeats=3, warmup=1)
    parser.add_argument(
        "--mode",
        choices=sorted(MODES),
        default="cost",
        help="cost: the cost model at real size; measure: the layouts on CPU processes",
    )
    parser.add_argument("--gpus", type=harness.positive_int, default=8, help="GPUs in the node")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU, TFLOP/s")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of peak a forward reaches")
    parser.add_argument("--link-gbs", type=float, default=900.0, help="GB/s a rank's collective bytes move at")
    parser.add_argument("--latency-us", type=float, default=10.0, help="fixed µs per collective or ring pass")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU (H100 80, H200 141)")
    parser.add_argument("--steps", type=harness.positive_int, default=50, help="denoising steps per sample")
    parser.add_argument("--qwen-prompt-tokens", type=harness.positive_int, default=64, help="Qwen-Image prompt tokens")
    parser.add_argument("--flux-true-cfg", action="store_true", help="FLUX.1-dev with true CFG (2 passes a step)")
    parser.add_argument(
        "--ring-overlap",
        action="store_true",
        help="ring passes overlap each block's attention (ring-flash-attn) instead of diffusers' K/V all-gather",
    )
    parser.add_argument(
        "--tie", type=float, default=0.005, help="throughput fraction a lower-latency pick may give up"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu {args.mfu} is not a fraction of peak: give a value in (0, 1], e.g. 0.4")
    doc = parallel_measure.__doc__ if args.mode == "measure" else __doc__
    report = harness.Report("parallel", args, doc, argv)
    MODES[args.mode](report, args)
    return report.finish()


if __name__ == "__main__":
    main()
