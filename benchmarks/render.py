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

Every timed benchmark runs its modes in interleaved rounds (round r runs them rotated by r, after
untimed warm-up rounds) and reports medians with min and max; percentiles are one definition
(linear interpolation between the closest ranks, numpy's default) everywhere. Ratios measured side
by side in one run are what to compare across machines; absolute times are this machine's.

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
    title = header["command"].removeprefix("python -m benchmarks.")
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


def render(reports: list[dict]) -> str:
    reports = sorted(reports, key=lambda report: report["header"]["started"])
    index = ["| benchmark | targets met | commit | machine |", "| --- | --- | --- | --- |"]
    for report in reports:
        header, targets = report["header"], report["targets"]
        title = header["command"].removeprefix("python -m benchmarks.")
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
    args = parser.parse_args(argv)
    paths = sorted(args.results.glob("*.json"))
    if not paths:
        parser.error(f"no JSON reports in {args.results}: run `make bench` (or a benchmark with --json) first")
    args.out.write_text(render([json.loads(path.read_text()) for path in paths]))
    print(f"rendered {len(paths)} reports into {args.out}")
    return args.out


if __name__ == "__main__":
    main()
