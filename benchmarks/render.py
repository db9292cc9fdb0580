"""Render the benchmarks' JSON reports into docs/benchmarks.md.

`make bench` runs every benchmark with `--json benchmarks/results/<name>.json` and then this, so
every figure on the page comes with the machine, the commit and the command that produced it.
Nobody types a number into that page.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.harness import ROOT

PREAMBLE = """\
# Benchmarks

After this page you know what each benchmark measures, what it measured on the machine named beside
it, and how to run it again. **This page is generated**: `make bench` runs every benchmark, writes
its JSON report under `benchmarks/results/` and renders this page from them with
`python -m benchmarks.render`; edit the benchmarks, not this page. Each benchmark's `--help` says
what it measures and why.

Every timed benchmark runs its modes in interleaved rounds (round r runs them rotated by r,
reversed in every other cycle, after untimed warm-up rounds) and reports medians with min and
max; percentiles are one definition (linear interpolation between the closest ranks, numpy's
default) everywhere. Ratios measured side by side in one run are what to compare across machines;
absolute times are this machine's.

**On a GPU**, `make bench-gpu` runs the GPU suite (`benchmarks/gpu_suite.py`: the real models'
throughput eager and compiled, on uni and on mp, MFU, memory peaks, LoRA merged vs. unmerged,
eager and compiled, bf16 re-scoring) in at most 8 minutes and renders its page, `docs/benchmarks_gpu.md`, the same way.

**Adding a benchmark.** A benchmark is a module in `benchmarks/` that keeps only its modes, its
checks and its summary; `benchmarks/harness.py` does the rest: `harness.parser(name, __doc__,
repeats=5, warmup=1, ...)` for the shared options (one name each, plus `--json`),
`harness.run_rounds` for interleaved rounds, `harness.Stats` for statistics,
`report.table(...)` for what it prints, `report.check(harness.Target(name, value, op, goal))` for
its targets and `report.finish()` for the JSON. It watches the engine through
`RolloutEngine.add_step_observer` (a `StepReport` per step and worker function: wall and executor
seconds, each rank's compute seconds and transformer rows), and times a worker's own pieces with
`benchmarks/worker_timers.py`, never by patching the engine. Add its line to `make bench`.
"""


def title_of(header: dict) -> str:
    """A report's name on the page: its command after "python -m benchmarks.", without `--json PATH`."""
    words = header["command"].removeprefix("python -m benchmarks.").split()
    if "--json" in words:
        del words[words.index("--json") : words.index("--json") + 2]
    return " ".join(words)


def markdown_table(table: dict) -> str:
    columns, rows = table["columns"], table["rows"]
    lines = [f"**{table['title'].strip()}**", "", "| " + " | ".join(columns) + " |"]
    lines.append("| " + " | ".join(["---"] * len(columns)) + " |")
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    if table.get("note"):
        lines += ["", table["note"]]
    return "\n".join(lines)


def render_report(report: dict) -> str:
    header = report["header"]
    title = title_of(header)
    parts = [
        f"## {title}",
        header["summary"],
        f"`{header['command']}`: commit `{header['commit']}`, torch {header['torch']}, "
        f"{header['threads']} threads, {header['device']} ({header['device_name']}), {header['started']}",
    ]
    parts += [markdown_table(table) for table in report["tables"]]
    if report["notes"]:
        parts.append("\n".join(f"- {note}" for note in report["notes"]))
    if report["targets"]:
        lines = ["Targets:", ""]
        for target in report["targets"]:
            verdict = "met" if target["met"] else "**MISSED**"
            value, goal = _number(target["value"]), _number(target["goal"])
            lines.append(f"- {target['name']}: {value} {target['op']} {goal}: {verdict}")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# The README's headline ratios: (benchmark command after "python -m benchmarks.", target name, what
# it compares). `render` writes them between the README's two markers, so they are generated too.
HEADLINES = (
    ("rollout_throughput --family sd3", "engine / diffusers speed", "SD3: the engine vs. `StableDiffusion3Pipeline`"),
    ("rollout_throughput --family flux", "engine / diffusers speed", "FLUX.1: the engine vs. `FluxPipeline`"),
    (
        "rollout_throughput --family qwen_image",
        "engine / diffusers speed",
        "Qwen-Image: the engine vs. `QwenImagePipeline`",
    ),
    ("rollout_throughput --family wan", "engine / diffusers speed", "Wan 2.1 video: the engine vs. `WanPipeline`"),
    ("serve_load", "server / in-process sync samples/s", "64 HTTP clients through the server vs. in process"),
    (
        "lora_rollout --family sd3 --merge-at-real-size sd35_medium",
        "merged r64 time / base time",
        "SD3 rollouts with a rank-64 LoRA merged vs. the base model",
    ),
)
HEADLINE_START, HEADLINE_END = (
    "<!-- headline ratios: rendered by benchmarks.render -->",
    "<!-- end of headline ratios -->",
)


def headline_lines(reports: list[dict]) -> list[str]:
    """One line per headline whose report is there: the ratio, its target and the machine."""
    by_title = {title_of(report["header"]): report for report in reports}
    lines = []
    for title, target_name, what in HEADLINES:
        report = by_title.get(title)
        target = next((t for t in report["targets"] if t["name"] == target_name), None) if report else None
        if target is not None:
            header = report["header"]
            lines.append(
                f"- {what}: {target['name']} {_number(target['value'])} (target {target['op']} "
                f"{_number(target['goal'])}; {header['device']}, {header['threads']} threads, `{header['commit']}`)"
            )
    return lines


def with_headlines(readme: str, reports: list[dict]) -> str:
    """The README with the lines between its headline markers replaced by `headline_lines`."""
    before, start, rest = readme.partition(HEADLINE_START)
    _, end, after = rest.partition(HEADLINE_END)
    if not start or not end:
        raise ValueError(f"README.md lacks the markers {HEADLINE_START!r} ... {HEADLINE_END!r}")
    return before + "\n".join([HEADLINE_START, *headline_lines(reports), HEADLINE_END]) + after


def render(reports: list[dict]) -> str:
    reports = sorted(reports, key=lambda report: report["header"]["started"])
    index = ["| benchmark | targets met | commit | machine |", "| --- | --- | --- | --- |"]
    for report in reports:
        header, targets = report["header"], report["targets"]
        title = title_of(header)
        anchor = "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")
        met = f"{sum(t['met'] for t in targets)} of {len(targets)}" if targets else "-"
        machine = f"{header['device']}, {header['threads']} threads"
        index.append(f"| [{title}](#{anchor}) | {met} | `{header['commit']}` | {machine} |")
    return "\n\n".join([PREAMBLE.rstrip(), "\n".join(index), *map(render_report, reports)]) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.render",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="folder of JSON reports")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the page to write")
    parser.add_argument(
        "--readme", type=Path, default=ROOT / "README.md", help="the README whose headline ratios to rewrite"
    )
    parser.add_argument(
        "--no-readme", action="store_true", help="keep the README's headline ratios (for the GPU suite's page)"
    )
    args = parser.parse_args(argv)
    paths = sorted(args.results.glob("*.json"))
    if not paths:
        parser.error(f"no JSON reports in {args.results}: run `make bench` (or a benchmark with --json) first")
    reports = [json.loads(path.read_text()) for path in paths]
    args.out.write_text(render(reports))
    if args.no_readme:
        print(f"rendered {len(paths)} reports into {args.out}")
        return args.out
    args.readme.write_text(with_headlines(args.readme.read_text(), reports))
    print(f"rendered {len(paths)} reports into {args.out} and the headline ratios of {args.readme}")
    return args.out


if __name__ == "__main__":
    main()
