"""The examples of the README and `docs/` run, so they cannot rot.

- A ```python block runs. The blocks of one page run in order in one namespace (a page reads as
  one session: a later block may use what an earlier one made), in a fresh working directory.
  A block is a script's text: no top-level `await` (a reader pastes it into a file, where that is a
  SyntaxError); async examples await inside an `async def` that `asyncio.run` runs.
- A ```python block whose fence info names a reason after the language (```python gpu,
  ```python model-folder, ```python sketch) needs what the tiny models cannot give (a GPU, a real
  model folder, the reader's own objects); it is only compiled.
- A ```bash line that runs `python -m MODULE ...` names a module that answers `--help`, and every
  `recipes/configs/*.yaml` it names exists; a `make TARGET` names a Makefile target.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Only-compiled blocks say why in their fence info: one of these words after the language.
COMPILE_ONLY = {"gpu", "model-folder", "sketch"}
FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    info: str  # the fence info after the language
    source: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    blocks, lines = [], page.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if match is None or not match.group(1):
            index += 1
            continue
        start, body = index, []
        index += 1
        while index < len(lines) and not lines[index].startswith("```"):
            body.append(lines[index])
            index += 1
        index += 1
        blocks.append(Block(page, start + 1, match.group(1), match.group(2).strip(), "\n".join(body) + "\n"))
    return blocks


def run_block(block: Block, namespace: dict) -> None:
    code = compile(block.source, block.where, "exec")  # a SyntaxError for a top-level await
    exec(code, namespace)  # noqa: S102 - our own documentation


def check_compile_only(block: Block) -> None:
    words = set(block.info.split())
    assert words & COMPILE_ONLY, (
        f"{block.where}: fence info {block.info!r} names no reason from {sorted(COMPILE_ONLY)}; "
        "a block that is not run must say why"
    )
    compile(block.source, block.where, "exec")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_python_examples_run(page: Path, tmp_path, monkeypatch) -> None:
    """Every runnable python block of the page runs, in order, in one namespace."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    for block in blocks_of(page):
        if block.language != "python":
            continue
        if block.info:
            check_compile_only(block)
            continue
        try:
            run_block(block, namespace)
        except Exception as error:
            raise AssertionError(f"the example at {block.where} raised {type(error).__name__}: {error}") from error
    for value in namespace.values():  # engines an example left open (a page may keep one to the end)
        if type(value).__name__ in ("RolloutEngine", "AsyncRolloutEngine", "RemoteRolloutEngine"):
            with contextlib.suppress(Exception):
                value.shutdown()


def bash_commands(block: Block) -> list[list[str]]:
    commands = []
    for line in block.source.replace("\\\n", " ").splitlines():  # a continued line is one command
        line = line.split(" #")[0].strip().rstrip("&").strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|;|\|", line):
            words = shlex.split(part)
            while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
                words = words[1:]
            if words:
                commands.append(words)
    return commands


def answers_help(module: str) -> tuple[bool, str]:
    """`python -m module --help` in this process: it must exit 0 with some text."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            # The module may be imported already (the tests import recipes.run): runpy warns that it
            # runs a second copy as __main__, which is what `--help` needs.
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        return exit_.code in (0, None) and bool(out.getvalue().strip()), out.getvalue()[-500:]
    finally:
        sys.argv = argv
    return False, "it returned without exiting: --help must print the options and exit"


def test_bash_examples_name_what_exists() -> None:
    """Every module a bash example runs answers --help; every config and make target exists."""
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    modules: dict[str, str] = {}
    problems = []
    for page in PAGES:
        for block in blocks_of(page):
            if block.language not in ("bash", "sh", "console"):
                continue
            for words in bash_commands(block):
                if words[0] == "make":
                    problems += [f"{block.where}: no make target {w!r}" for w in words[1:2] if w not in targets]
                if words[0].startswith("python") and "-m" in words:
                    module = words[words.index("-m") + 1]
                    modules.setdefault(module, block.where)
                for word in words:
                    if word.startswith("recipes/configs/") and not (ROOT / word).is_file():
                        problems.append(f"{block.where}: {word} does not exist")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for module, where in sorted(modules.items()):
            if module in ("pip", "venv", "pytest"):
                continue
            ok, tail = answers_help(module)
            if not ok:
                problems.append(f"{where}: python -m {module} --help did not answer: {tail}")
    finally:
        os.chdir(cwd)
    assert not problems, "\n".join(problems)


def test_compile_only_blocks_say_why() -> None:
    """A python block that is not run names its reason (and compiles): nothing is skipped silently."""
    for page in PAGES:
        for block in blocks_of(page):
            if block.language == "python" and block.info:
                check_compile_only(block)
