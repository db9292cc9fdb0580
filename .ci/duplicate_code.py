"""Copied code fails lint: pylint's duplicate-code checker (symilar) over the packages, on runs of
`--lines` identical lines or more, comments, docstrings and function signatures aside.

Signatures are left aside because the three engine fronts write out the same ones by design
(`tests/test_api.py` holds them equal). symilar's own `--ignore-signatures` parses every file
with astroid first (2 min 20 s for this tree on 2 cores); here Python's `ast` finds the same lines
(a function's, from its `def` to its body's first line) and blanks them in copies of the files,
so symilar reads them as text, as it does the rest, in about a second.

    python .ci/duplicate_code.py --lines 8 rollout executors trainers_adapters recipes benchmarks
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
from pathlib import Path


def without_signatures(text: str) -> str:
    """`text` with the lines of every function's signature blank (line numbers kept)."""
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for number in range(node.lineno, node.body[0].lineno):
                lines[number - 1] = "\n"
    return "".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=8, help="the shortest run of shared lines that fails")
    parser.add_argument("packages", nargs="+", help="folders whose .py files are compared")
    args = parser.parse_args()
    files = sorted(path for package in args.packages for path in Path(package).rglob("*.py"))
    with tempfile.TemporaryDirectory() as copies:
        for path in files:
            copy = Path(copies, path)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(without_signatures(path.read_text()))
        command = [sys.executable, "-m", "pylint.checkers.symilar", f"--duplicates={args.lines}"]
        command += ["--ignore-comments", "--ignore-docstrings", *map(str, files)]
        report = subprocess.run(command, cwd=copies, capture_output=True, text=True, check=False).stdout
    print(report.strip())
    return 0 if " duplicates=0 " in report else 1


if __name__ == "__main__":
    sys.exit(main())
