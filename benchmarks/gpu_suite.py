"""The GPU suite: every speed and numerics figure the engine is held to, on one GPU, in one command.

`make bench-gpu` runs it (after installing any wheels it is given: a GPU machine's Python may lack
diffusers). It runs the benchmarks below one after another, each in its own process with the
published configs' transformers at random weights (`--preset real`; nothing is downloaded), in
bfloat16, and writes each one's JSON report into `--results`, plus its own report of what ran:

  throughput_F   `rollout_throughput --family F --compile both`: the engine eager and with compiled
                 blocks vs. diffusers' pipeline vs. the transformer forwards alone (both eager),
                 images/s, MFU and the memory peak of each call; F = sd3 (SD3.5 Medium, CFG),
                 flux (FLUX.1-dev, guidance distilled), wan (Wan 2.1 1.3B, 480x832x33, CFG),
                 qwen_image (Qwen-Image, true CFG; eager only, see below);
  rescore_sd3    `rescore_batches --compile blocks`: a compiled rollout of 16 re-scored by the
                 trainer's bf16 copy, compiled and eager, at micro-batches 1, 2, 4 and 16, and one
                 prompt alone vs. in a batch;
  lora_sd3_E     `lora_rollout --executor E`: a rank-64 LoRA merged vs. unmerged vs. the base, on
                 `uni` and on `mp`;
  lora_sd3_uni_compiled  the same on `uni` with compiled blocks: what an unmerged adapter (the
                 bfloat16 default, which re-scores exactly) costs once compiled;
  throughput_sd3_mp  `rollout_throughput --family sd3 --compile both --also-on mp`: the eager and the
                 compiled engine on `mp` beside the same on `uni` (Ray is left out: the GPU
                 machine's Python has none, and each Ray engine would hold the whole GPU);
  weight_sync    `weight_sync --device cuda --backends uni mp`: its own SD3 transformer (219 MB of
                 float32) pushed from the trainer's copy on the GPU into a `uni` and an `mp`
                 engine, >= 8 GB/s per replica.

`rollout_throughput` holds a copy of the model per engine and one for the pipeline diffusers and the
floor run: three with `--compile both` (FLUX.1-dev: 3 x 24 GB). Qwen-Image's 20B parameters take
2 x 41 GB in bfloat16 even eager, more than an 80 GB card has, so its part fails there (and says so
in its log); run the suite on a card of 141 GB for it.

The suite holds to `--budget-s` (8 minutes): each benchmark gets at most its share of what is
left, the most important first, and one that does not finish is reported as cut off rather than
holding up the rest. The pipeline a family's benchmarks share is built once (`--model-folder`) in
`--scratch` and removed after them. Render the reports with
`python -m benchmarks.render --results benchmarks/results/gpu --out docs/benchmarks_gpu.md --no-readme`.

    python -m benchmarks.gpu_suite                                   # the real models, on cuda
    python -m benchmarks.gpu_suite --only throughput_sd3 rescore_sd3
    python -m benchmarks.gpu_suite --preset small --device cpu --dtype float32 --steps 2 --batch-size 2
                                                                      # the same commands, CPU-sized
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness

# Dense bfloat16 peak TFLOP/s by the name torch gives the device (without sparsity), for MFU.
PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


@dataclass
class Part:
    """One benchmark run of the suite: its name, its module and arguments, the family whose
    pipeline it builds, and the most seconds it may take (`cap_s`) when the budget allows."""

    name: str
    module: str
    arguments: list[str]
    family: str
    cap_s: float
    suite_options: bool = True  # takes the suite's --preset, --device, --dtype and --model-folder


def parts(args: argparse.Namespace) -> list[Part]:
    """The suite's benchmarks, the most important first."""
    steps = [] if args.steps is None else ["--steps", str(args.steps)]
    batch = [] if args.batch_size is None else ["--batch-size", str(args.batch_size)]
    sized = steps + batch
    rounds = ["--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    mfu = [] if args.peak_tflops is None else ["--peak-tflops", str(args.peak_tflops)]

    def throughput(
        family: str, cfg: str, cap_s: float, batch_size: int | None = None, compile="both", also_on: str = ""
    ) -> Part:
        # The largest models sample fewer images per call, so their modes fit the budget.
        own = [] if batch_size is None or batch else ["--batch-size", str(batch_size)]
        arguments = ["--family", family, "--cfg", cfg, "--compile", compile, *mfu, *rounds, *sized, *own]
        if also_on:  # the engine modes on another executor too; the uni breakdown is the first part's
            arguments += ["--also-on", also_on, "--no-breakdown"]
        return Part(f"throughput_{family}{also_on and '_' + also_on}", "rollout_throughput", arguments, family, cap_s)

    def lora(executor: str, cap_s: float, compile: str = "off") -> Part:
        arguments = ["--family", "sd3", "--executor", executor, "--ranks", "64", "--compile", compile, *rounds, *sized]
        name = f"lora_sd3_{executor}" + ("_compiled" if compile == "blocks" else "")
        return Part(name, "lora_rollout", arguments, "sd3", cap_s)

    # Caps: a real model's build and load, the compiles in the warm-up round, then the rounds.
    return [
        throughput("sd3", "on", 150),
        Part("rescore_sd3", "rescore_batches", ["--family", "sd3", "--compile", "blocks", *sized], "sd3", 90),
        throughput("flux", "off", 170, batch_size=8),
        throughput("wan", "on", 120),
        lora("uni", 50),
        lora("mp", 60),
        lora("uni", 80, compile="blocks"),
        throughput("sd3", "on", 120, also_on="mp"),
        throughput("qwen_image", "on", 130, batch_size=4, compile="off"),
        # A full transformer pushed from a trainer copy on the GPU: >= 8 GB/s per replica.
        Part(
            "weight_sync",
            "weight_sync",
            ["--device", args.device, "--backends", "uni", "mp", *rounds],
            "sd3",
            90,
            False,
        ),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser("gpu_suite", __doc__, device="cuda", dtype="bfloat16")
    parser.add_argument("--preset", choices=("small", "real"), default="real", help="the benchmarks' --preset")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole suite's wall-clock seconds")
    parser.add_argument("--only", nargs="+", metavar="PART", help="run only these parts (None: all, in order)")
    parser.add_argument("--steps", type=harness.positive_int, help="every part's --steps (None: its own)")
    parser.add_argument("--batch-size", type=harness.positive_int, help="every part's --batch-size (None: its own)")
    parser.add_argument("--warmup", type=harness.count, default=1, help="every benchmark's warm-up rounds")
    parser.add_argument("--repeats", type=harness.positive_int, default=2, help="every benchmark's timed rounds")
    parser.add_argument(
        "--peak-tflops", type=float, help="the device's dense peak TFLOP/s in --dtype (None: looked up by its name)"
    )
    parser.add_argument(
        "--results", type=Path, default=harness.ROOT / "benchmarks" / "results" / "gpu", help="folder of the reports"
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        help="where the pipelines are built (None: /dev/shm when it has 64 GiB free, else the temp folder)",
    )
    args = parser.parse_args(argv)
    names = [part.name for part in parts(args)]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        parser.error(f"unknown --only part(s) {unknown}; choose from {names}")
    return args


def peak_tflops(device: str) -> float | None:
    """The device's dense bf16 peak from `PEAK_TFLOPS` by its name; None when not listed (or a CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((value for key, value in PEAK_TFLOPS.items() if key in name), None)


def scratch_folder() -> Path:
    """/dev/shm when it has room for Qwen-Image's 40 GB (memory is faster to write and read than
    the disk), else the temporary folder."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free >= 64 * 2**30:
        return shm
    return Path(tempfile.gettempdir())


def run_part(part: Part, args: argparse.Namespace, folder: Path, timeout_s: float) -> tuple[str, float]:
    """Run one part in its own process, its output in `<results>/logs/<name>.log`; returns its
    status ("ok", "failed (rc N)" or "cut off") and its seconds."""
    suite = ["--preset", args.preset, "--device", args.device, "--dtype", args.dtype, "--model-folder", str(folder)]
    command = [
        sys.executable,
        "-m",
        f"benchmarks.{part.module}",
        *part.arguments,
        *(suite if part.suite_options else []),
        "--json",
        str(args.results / f"{part.name}.json"),
    ]
    log = args.results / "logs" / f"{part.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as out:
        out.write(" ".join(command) + "\n")
        out.flush()
        try:
            done = subprocess.run(command, cwd=harness.ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return "cut off", time.perf_counter() - start
    status = "ok" if done.returncode == 0 else f"failed (rc {done.returncode})"
    return status, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.peak_tflops is None:
        args.peak_tflops = peak_tflops(args.device)
    args.json = args.json or args.results / "gpu_suite.json"
    report = harness.Report("gpu_suite", args, __doc__, argv)
    if args.peak_tflops is None:
        report.note("MFU is not reported: the device's peak is unknown (give --peak-tflops)")
    chosen = [part for part in parts(args) if args.only is None or part.name in args.only]
    scratch = Path(tempfile.mkdtemp(prefix="rollout-gpu-suite-", dir=args.scratch or scratch_folder()))
    deadline = time.perf_counter() + args.budget_s
    rows = []
    try:
        for index, part in enumerate(chosen):
            left = deadline - time.perf_counter()
            # Each part may take its cap, but never so much that the parts after it get nothing.
            later = sum(p.cap_s for p in chosen[index + 1 :])
            timeout_s = min(part.cap_s * max(1.0, left / (part.cap_s + later)), left)
            if timeout_s < 10:
                rows.append([part.name, "skipped (budget spent)", 0.0])
                continue
            print(f"[{index + 1}/{len(chosen)}] {part.name} (at most {timeout_s:.0f} s)", flush=True)
            status, seconds = run_part(part, args, scratch / part.family, timeout_s)
            rows.append([part.name, status, seconds])
            print(f"    {status} in {seconds:.0f} s", flush=True)
            if all(p.family != part.family for p in chosen[index + 1 :]):
                shutil.rmtree(scratch / part.family, ignore_errors=True)  # room for the next family's
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report.table(
        "what ran",
        ["part", "status", "seconds"],
        rows,
        note=f"each part's report is <part>.json beside this one, its output logs/<part>.log; "
        f"budget {args.budget_s:.0f} s",
    )
    report.results = {"parts": {name: {"status": status, "seconds": seconds} for name, status, seconds in rows}}
    report.check(harness.Target("suite seconds", sum(row[2] for row in rows), "<=", args.budget_s))
    return report.finish()


if __name__ == "__main__":
    main()
