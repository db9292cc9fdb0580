"""What every benchmark shares: its arguments, its rounds, its statistics, its targets and its report.

A benchmark keeps only its modes, its checks and its summary:

    parser = harness.parser("lora_swap", __doc__, repeats=50, warmup=2)
    parser.add_argument("--rank", ...)               # its own options
    args = parser.parse_args(argv)
    report = harness.Report("lora_swap", args, __doc__, argv)
    times = harness.run_rounds({"swap": swap, "load": load}, args.warmup, args.repeats)
    report.table("hot swap", ["mode", "median ms"], [[mode, 1e3 * harness.Stats.of(t["s"]).median] ...])
    report.check(harness.Target("swap median ms", value, "<", 50))
    report.finish()                                  # prints the targets, writes --json

`python -m benchmarks.render` turns the JSON reports into docs/benchmarks.md: the tables, the
targets and each report's header (commit, torch, threads, device, command line) as they were run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import operator
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# Arguments. Each shared option has one name, one meaning and one help text; a benchmark picks the
# ones it takes and their defaults: `parser("name", __doc__, repeats=5, warmup=1, device="cpu")`.


def add_recipe_overrides(group, applies_to: str) -> None:
    """`--set KEY=VALUE` (repeatable, into `overrides`): a recipe setting for `applies_to`, as
    `python -m recipes.run --set` takes it, for a benchmark that runs training recipes."""
    group.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a recipe setting for {applies_to}, as python -m recipes.run --set takes it (repeatable)",
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


SHARED_ARGUMENTS: dict[str, dict] = {
    "repeats": {"type": positive_int, "help": "timed rounds; each runs every mode once, in a rotated order"},
    "warmup": {"type": count, "help": "untimed rounds first (allocator, caches, first calls)"},
    "threads": {"type": positive_int, "help": "torch threads of this process (and of a uni worker)"},
    "device": {"help": "cpu or cuda[:N]: where the models run"},
    "dtype": {"choices": ("float32", "bfloat16", "float16"), "help": "the models' dtype"},
    "model": {"type": Path, "help": "a local pipeline folder (default: build the tiny one in a temporary folder)"},
    "model_folder": {
        "type": Path,
        "help": "build the benchmark's pipeline in this folder once, and reuse it on later runs of the same family, "
        "preset and dtype (default: a temporary folder, removed after the run)",
    },
}


def parser(name: str, doc: str, **defaults) -> argparse.ArgumentParser:
    """An argument parser for `python -m benchmarks.<name>`: the docstring's first paragraph as its
    description and the rest as its epilog, the shared options named in `defaults` (with those
    defaults), and `--json`."""
    summary, _, details = doc.strip().partition("\n\n")
    result = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}",
        description=summary,
        epilog=details or None,
        formatter_class=_Formatter,
    )
    shared = result.add_argument_group("shared benchmark options")
    for option, default in defaults.items():
        shared.add_argument(f"--{option.replace('_', '-')}", default=default, **SHARED_ARGUMENTS[option])
    shared.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")
    return result


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help, and the docstring's layout kept."""


# Rounds.


@dataclass(frozen=True)
class Round:
    index: int  # 0-based over warmup and timed rounds (benchmarks also use it as a seed)
    timed: bool
    tag: str  # "warmup k/n" or "round k/n", for the progress lines
    order: list  # the modes, rotated by `index`, reversed in every other cycle


def interleaved_rounds(modes: Iterable, warmup: int, repeats: int) -> Iterator[Round]:
    """`warmup` untimed rounds, then `repeats` timed ones; round r runs the modes rotated by r, and
    reversed in every other cycle of len(modes) rounds, so each mode runs first as often as the
    others and, over two cycles, follows each of the others (they share the machine's state, caches
    and load alike). A rotation alone keeps the cycle: each mode would always follow the same one,
    and whatever that one leaves behind (memory the allocator hands back, a cold cache) would count
    against it in every round."""
    modes = list(modes)
    for index in range(warmup + repeats):
        timed = index >= warmup
        rotation = index % len(modes)
        order = modes[rotation:] + modes[:rotation]
        tag = f"round {index - warmup + 1}/{repeats}" if timed else f"warmup {index + 1}/{warmup}"
        yield Round(index, timed, tag, order[::-1] if index // len(modes) % 2 else order)


Measurement = float | dict[str, float]  # a mode's seconds, or several named measurements


def run_rounds(
    modes: dict[str, Callable[[Round], Measurement]], warmup: int, repeats: int, *, quiet: bool = False
) -> dict[str, dict[str, list[float]]]:
    """Run every mode once per round (see `interleaved_rounds`); returns mode -> measurement name ->
    the timed rounds' values. A mode returns its seconds (kept as "s") or a dict of measurements."""
    samples: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    for round_ in interleaved_rounds(modes, warmup, repeats):
        for mode in round_.order:
            measured = modes[mode](round_)
            measured = measured if isinstance(measured, dict) else {"s": measured}
            if not quiet:
                shown = "  ".join(f"{name} {value:.4g}" for name, value in measured.items())
                print(f"  [{round_.tag}] {mode:<24} {shown}", flush=True)
            if round_.timed:
                for name, value in measured.items():
                    samples[mode].setdefault(name, []).append(value)
    return samples


def synchronize(device: str | None) -> None:
    if device is not None and device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed_call(fn: Callable, *args, device: str | None = None) -> tuple[object, float]:
    """`fn(*args)` and its wall seconds, timed after a garbage collection; on a CUDA `device` the
    device is synchronized before and after, so queued kernels count where they were launched."""
    gc.collect()
    synchronize(device)
    start = time.perf_counter()
    result = fn(*args)
    synchronize(device)
    return result, time.perf_counter() - start


@contextlib.contextmanager
def step_reports(engine) -> Iterator[list]:
    """The engine's `StepReport`s while inside: a list that fills as the engine steps and calls its
    workers (`RolloutEngine.add_step_observer`), observed no more on the way out."""
    reports: list = []
    remove = engine.add_step_observer(reports.append)
    try:
        yield reports
    finally:
        remove()


# Statistics: one type, one percentile definition, so two reports compare.


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) by linear interpolation between the closest ranks (numpy's
    default, and `statistics.quantiles(method="inclusive")`): 50 is the median, 0 the min, 100 the max."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Stats:
    """Median, min, max and percentiles of some measurements (already in their unit)."""

    values: tuple[float, ...]
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float], scale: float = 1.0) -> Stats:
        values = tuple(scale * value for value in values)
        if not values:
            raise ValueError("statistics of no values")
        return cls(values, statistics.median(values), min(values), max(values))

    def percentile(self, q: float) -> float:
        return percentile(self.values, q)

    def to_json(self) -> dict:
        return {
            "n": len(self.values),
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "p90": self.percentile(90),
            "p99": self.percentile(99),
            "values": list(self.values),
        }


def per_round_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of the rounds' ratios (the modes of one round run seconds apart, so they share the
    machine's load)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


# Targets as data.

_OPERATORS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq}


@dataclass(frozen=True)
class Target:
    """`value op goal`, e.g. Target("engine / diffusers speed", 1.01, ">=", 0.95)."""

    name: str
    value: float
    op: str
    goal: float

    def __post_init__(self) -> None:
        if self.op not in _OPERATORS:
            raise ValueError(f"Target {self.name!r}: op {self.op!r} is not one of {sorted(_OPERATORS)}")

    @property
    def met(self) -> bool:
        return bool(_OPERATORS[self.op](self.value, self.goal))

    def __str__(self) -> str:
        verdict = "met" if self.met else "MISSED"
        return f"{self.name}: {format_cell(self.value)} {self.op} {format_cell(self.goal)}: {verdict}"


# Tables.


def format_cell(value) -> str:
    """Floats with 4 significant digits (no exponent below 1e6), the rest as str."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if value != value or value in (math.inf, -math.inf):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        digits = max(0, 3 - math.floor(math.log10(abs(value)))) if value else 0
        return f"{value:.{digits}f}"
    return f"{value:.3e}"


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]  # cells as shown
    note: str = ""

    def text(self) -> str:
        """The table as a terminal shows it: columns of numbers right-aligned, the others left-aligned."""
        columns = list(zip(self.columns, *self.rows, strict=True))
        widths = [max(len(cell) for cell in column) for column in columns]
        numeric = [all(_is_number(cell) for cell in column[1:]) for column in columns]

        def line(cells) -> str:
            return "  ".join(
                f"{c:>{w}}" if right else f"{c:<{w}}" for c, w, right in zip(cells, widths, numeric, strict=True)
            ).rstrip()

        rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
        body = [line(row) for row in self.rows]
        return "\n".join([f"\n{self.title}", line(self.columns), rule, *body] + ([self.note] if self.note else []))


def _is_number(cell: str) -> bool:
    try:
        float(cell.rstrip("%x"))
    except ValueError:
        return cell in ("", "-")
    return True


# The report.


def _commit() -> str | None:
    """HEAD's commit, with "-dirty" when the tree has changes; None outside a git checkout."""
    try:
        run = dict(cwd=ROOT, capture_output=True, text=True, timeout=10, check=True)
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return f"{model or platform.processor() or 'cpu'}, {os.cpu_count()} cores"


@dataclass
class Report:
    """A benchmark's output: its tables and targets printed as they come, and as JSON with a header
    that says what produced them."""

    name: str
    args: argparse.Namespace
    doc: str = ""
    argv: list[str] | None = None  # what main(argv) was given; None: this process's command line
    header: dict = field(init=False)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    results: dict = field(default_factory=dict)  # the benchmark's numbers, JSON-ready

    def __post_init__(self) -> None:
        device = str(vars(self.args).get("device") or "cpu")
        argv = sys.argv[1:] if self.argv is None else self.argv
        command = " ".join([f"python -m benchmarks.{self.name}", *argv])
        self.header = {
            "benchmark": self.name,
            "summary": self.doc.strip().split("\n\n")[0].replace("\n", " "),
            "commit": _commit(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": command,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": device,
            "device_name": _device_name(device),
            "python": platform.python_version(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()},
        }
        print(
            f"{self.header['command']}\ncommit {self.header['commit']}, torch {self.header['torch']}, "
            f"threads {self.header['threads']}, device {device} ({self.header['device_name']})",
            flush=True,
        )

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence], note: str = "") -> Table:
        table = Table(title, list(columns), [[format_cell(cell) for cell in row] for row in rows], note)
        self.tables.append(table)
        print(table.text(), flush=True)
        return table

    def note(self, text: str) -> None:
        """A line of prose for the reader of the report (printed, and rendered under the tables)."""
        self.notes.append(text)
        print(text, flush=True)

    def check(self, target: Target) -> Target:
        self.targets.append(target)
        return target

    @property
    def all_met(self) -> bool:
        return all(target.met for target in self.targets)

    def to_json(self) -> dict:
        return {
            "header": self.header,
            "tables": [asdict(table) for table in self.tables],
            "notes": self.notes,
            "targets": [asdict(target) | {"met": target.met} for target in self.targets],
            "results": self.results,
        }

    def finish(self) -> dict:
        """Print the targets, write the JSON report where `--json` says; returns the report."""
        if self.targets:
            print("\ntargets:")
            for target in self.targets:
                print(f"  {target}")
        report = self.to_json()
        path = vars(self.args).get("json")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1, default=_json_default) + "\n")
            print(f"\nwrote {path}")
        return report


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Stats):
        return value.to_json()
    if isinstance(value, torch.dtype):
        return str(value)
    raise TypeError(f"a report holds {type(value).__name__}, which JSON cannot: convert it first")
