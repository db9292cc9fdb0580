"""The packages' import graph has no cycle, nothing imports a package it must not, and every module
imports on its own.

Every import statement counts, at module level and inside functions alike: an import moved into a
function to dodge a cycle still makes one (the cycle is only hidden until that function runs).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import rollout

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout", "executors", "trainers_adapters", "recipes", "benchmarks")

pytestmark = pytest.mark.timeout(180)


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


# Packages whose __init__ names each public object's module in a table and imports it on first use
# (PEP 562): `from rollout import EngineConfig` loads rollout.config, not the whole table (whose
# `TYPE_CHECKING` imports in rollout/__init__.py count as that package's own edges).
LAZY_TABLES = {"rollout": rollout.PUBLIC_NAMES}


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module `name` imports anywhere in its file. `from pkg import x`
    imports module `pkg.x` when there is one, the module a lazy table names for `x`, else `pkg`
    itself (its __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if base in LAZY_TABLES and alias.name in LAZY_TABLES[base]:  # loads that module only
                    targets.add(LAZY_TABLES[base][alias.name])
                else:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {target for target in targets if target in modules and target != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycle():
    modules = project_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert sum(len(targets) for targets in graph.values()) > 200  # the walk saw the imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_function_level_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert cycles(graph) == [["a", "b"]]


def test_a_name_from_the_lazy_table_is_an_import_of_its_module_only(tmp_path):
    (tmp_path / "user.py").write_text("from rollout import EngineConfig, NodeId\n")
    modules = {name: Path() for name in ("rollout", "rollout.config", "rollout.node_id", "rollout.serve.client")}
    assert imported_modules("user", tmp_path / "user.py", modules) == {"rollout.config", "rollout.node_id"}


# (importer, imported): no module under the first reaches one under the second, directly or through
# other project modules. The reward service shares the rollout server's HTTP hardening through
# `rollout.http`; it never loads the server.
FORBIDDEN = [("trainers_adapters.rewards", "rollout.serve")]


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def forbidden_chains(graph: dict[str, set[str]], importer: str, imported: str) -> list[list[str]]:
    """For each module under `importer` that reaches a module under `imported`, one shortest chain
    of imports from it to there (breadth first over the project's import graph)."""
    chains = []
    for start in sorted(name for name in graph if under(name, importer)):
        parent: dict[str, str | None] = {start: None}
        frontier = [start]
        while frontier:
            found = next((name for name in frontier if under(name, imported)), None)
            if found is not None:
                chain = [found]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                chains.append(chain[::-1])
                break
            following = []
            for name in frontier:
                for target in sorted(graph[name]):
                    if target not in parent:
                        parent[target] = name
                        following.append(target)
            frontier = following
    return chains


@pytest.mark.parametrize(("importer", "imported"), FORBIDDEN)
def test_no_module_imports_a_package_it_must_not(importer, imported):
    modules = project_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert any(under(name, importer) and name != importer for name in graph)  # the rule names a package
    chains = forbidden_chains(graph, importer, imported)
    assert not chains, "\n".join(f"{chain[0]} imports {chain[-1]}: " + " -> ".join(chain) for chain in chains)


def test_the_rule_names_both_modules_and_the_chain_between_them():
    graph = {"a.x": {"b.y"}, "b.y": {"c.z"}, "c.z": set(), "a.w": {"c"}, "c": set()}
    assert forbidden_chains(graph, "a", "c") == [["a.w", "c"], ["a.x", "b.y", "c.z"]]
    assert forbidden_chains(graph, "b", "a") == []


@pytest.mark.slow  # the static walk above runs by default: CI runs it (make test-slow)
def test_every_module_imports_on_its_own():
    """Each module is imported with none of the project's modules loaded before it (third-party
    libraries stay loaded, so this takes seconds, not a process per module). A `__main__` module
    is a command: importing it runs it, so it is left out."""
    names = sorted(name for name in project_modules() if not name.endswith("__main__"))
    script = f"""
import importlib, sys, traceback
sys.path.insert(0, {str(ROOT)!r})
packages = {PACKAGES!r}
failed = []
for name in {names!r}:
    for loaded in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=3))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr


# The layers, top to bottom: a module imports only its own layer and those below it. The worker's
# features (weights, LoRA, parallel groups) sit with the worker, and so does the wire format both
# HTTP services share (rollout.http reads tensors as the weights' files do), under all that serves.
LAYERS = {
    "rollout.serve": 5,
    "rollout.engine": 4,
    "executors": 3,
    "rollout.worker": 2,
    "rollout.weights": 2,
    "rollout.lora": 2,
    "rollout.parallel": 2,
    "rollout.http": 2,
    "rollout.pipelines": 1,
    "rollout.samplers": 1,
}
# rollout's own top-level modules are the vocabulary every layer speaks (configs, parameters,
# outputs, errors, the step messages): they import only each other and the pipelines and samplers.
VOCABULARY_MAY_IMPORT = ("rollout.pipelines", "rollout.samplers")


def layer_of(name: str) -> int | None:
    for package, layer in LAYERS.items():
        if name == package or name.startswith(package + "."):
            return layer
    return None


def is_vocabulary(name: str, modules: dict[str, Path]) -> bool:
    """A module at rollout's top level (rollout/x.py), not the package's public table."""
    return name.count(".") == 1 and name.startswith("rollout.") and modules[name].name != "__init__.py"


def direction_violations(modules: dict[str, Path]) -> list[str]:
    found = []
    for name, path in sorted(modules.items()):
        for target in sorted(imported_modules(name, path, modules)):
            if is_vocabulary(name, modules):
                if not (is_vocabulary(target, modules) or target.startswith(VOCABULARY_MAY_IMPORT)):
                    found.append(f"{name} (rollout's vocabulary) imports {target}")
            elif (mine := layer_of(name)) is not None and (theirs := layer_of(target)) is not None and theirs > mine:
                found.append(f"{name} (layer {mine}) imports {target} (layer {theirs}, above it)")
    return found


def test_imports_go_down_the_layers():
    """serve -> engine -> executors -> worker (and its weights, LoRA, parallel groups) -> pipelines
    and samplers; rollout's top-level modules import only each other and the pipelines and samplers."""
    assert direction_violations(project_modules()) == []


def test_a_worker_module_importing_the_engine_is_named_with_both_modules(tmp_path):
    modules = project_modules()
    bad = tmp_path / "bad.py"
    bad.write_text("from rollout.engine.scheduler import Scheduler\n")
    modules["rollout.worker.bad"] = bad
    assert "rollout.worker.bad (layer 2) imports rollout.engine.scheduler (layer 4, above it)" in (
        direction_violations(modules)
    )
