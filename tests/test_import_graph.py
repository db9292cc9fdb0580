"""The packages' import graph has no cycle, every module has a layer and imports only down the
layers, nothing imports a package it must not, and every module imports on its own.

Every import counts, at module level and inside functions alike: an import moved into a function
to dodge a cycle still makes one (the cycle is only hidden until that function runs). So do the
imports that are not statements: a name of a lazy public table (`from rollout import X` loads
X's module), a string that is a project module's dotted path (what `importlib`, `import_by_path`
and the executors' and recipes' tables load), and the modules the families' and samplers'
registries load by derived names.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

import rollout
import trainers_adapters

ROOT = Path(__file__).resolve().parents[1]
VOCABULARY = "rollout's vocabulary"  # rollout/x.py: the modules at rollout's top level
PACKAGES = ("rollout", "executors", "trainers_adapters", "recipes", "benchmarks", "tests")

pytestmark = pytest.mark.timeout(180)


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages (a copy a test may add to)."""
    return dict(_project_modules())


@functools.cache
def _project_modules() -> dict[str, Path]:
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
LAZY_TABLES = {"rollout": rollout.PUBLIC_NAMES, "trainers_adapters": trainers_adapters.PUBLIC_NAMES}


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module `name` imports anywhere in its file. `from pkg import x`
    imports module `pkg.x` when there is one, the module a lazy table names for `x`, else `pkg`
    itself (its __init__). A string that is a module's dotted path ("pkg.mod", "pkg.mod.Class" or
    "pkg.mod:Class", what `importlib` and the registries load) imports that module; docstrings and
    messages (strings with spaces) do not."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = parsed(path)
    targets = set()
    for node in ast.walk(tree):
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
    # Loaded by name: a package that loads its own modules so (its lazy table) adds no edge, or
    # each of them importing the package back would be a cycle that never runs.
    docstrings = {id(node.body[0].value) for node in ast.walk(tree) if _has_docstring(node)}
    by_name = set(registries().get(name, set()))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            by_name.add(module_named_by(node.value, modules))
    targets |= {target for target in by_name - {None} if not target.startswith(name + ".")}
    return {target for target in targets if target in modules and target != name}


def _has_docstring(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and bool(node.body)
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    )


def module_named_by(text: str, modules: dict[str, Path]) -> str | None:
    """The project module a dotted path names: "pkg.mod", "pkg.mod.Attr" or "pkg.mod:Attr"."""
    if " " in text or "." not in text:
        return None
    path = text.split(":")[0]
    if path in modules:
        return path
    module, _, attribute = path.rpartition(".")
    if module in LAZY_TABLES:  # "rollout.EngineConfig": the module the table loads for it
        return LAZY_TABLES[module].get(attribute)
    return module if module in modules and modules[module].name != "__init__.py" else None


@functools.cache
def registries() -> dict[str, set[str]]:
    """The modules registries load by names they derive rather than spell out: each family's
    adapter, tiny builder and presets (from its folder and name), each sampler (`get_sampler`),
    each recipe (`recipe_module`)."""
    from recipes.loading import RECIPES
    from rollout.pipelines.families import FAMILIES
    from rollout.samplers import SAMPLER_NAMES

    family_paths = {
        path for family in FAMILIES for path in (family.adapter_class, family.tiny_builder, *family.presets.values())
    }
    modules = project_modules()
    return {
        "rollout.pipelines.families": {module_named_by(path, modules) for path in family_paths} - {None},
        "rollout.samplers": {f"rollout.samplers.{sampler}" for sampler in SAMPLER_NAMES},
        "recipes.loading": set(RECIPES.values()),
    }


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


# The layers, top to bottom: a module imports modules of its own package (a key below) and of the
# layers under it, never one of another package of its layer or above. rollout's own top-level
# modules are the vocabulary every layer speaks (configs, parameters, outputs, errors, the step
# messages, conditions, guidance, model specs): above the samplers only. The worker's features
# (weights, LoRA, parallel groups) sit under the worker, and so does the wire format both HTTP
# services share (rollout.http reads tensors as the weights' files do). rollout's public table
# (its __init__) sits above all that it names; what uses rollout sits above it.
LAYERS = {
    "tests": 13,
    "benchmarks": 12,
    "recipes": 11,
    "trainers_adapters": 10,
    "rollout": 9,  # the package's public table, rollout/__init__.py
    "rollout.serve": 8,
    "rollout.engine": 7,
    "executors": 6,
    "rollout.worker": 5,
    "rollout.lora": 4,
    "rollout.http": 4,
    "rollout.weights": 3,
    "rollout.parallel": 3,
    "rollout.pipelines": 2,
    VOCABULARY: 1,
    "rollout.samplers": 0,
}


def package_of(name: str, modules: dict[str, Path]) -> str | None:
    """The key of LAYERS `name` falls under: the longest package that holds it, or VOCABULARY."""
    if name.count(".") == 1 and name.startswith("rollout.") and modules[name].name != "__init__.py":
        return VOCABULARY
    found = [package for package in LAYERS if name == package or name.startswith(package + ".")]
    return max(found, key=len, default=None)


def direction_violations(modules: dict[str, Path]) -> list[str]:
    found = []
    for name, path in sorted(modules.items()):
        mine = package_of(name, modules)
        if mine is None:
            found.append(f"{name} has no layer: add its package to LAYERS")
            continue
        for target in sorted(imported_modules(name, path, modules)):
            theirs = package_of(target, modules)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                where = "above it" if LAYERS[theirs] > LAYERS[mine] else "beside it"
                layers = f"layer {LAYERS[mine]}) imports {target} ({theirs}, layer {LAYERS[theirs]}"
                found.append(f"{name} ({mine}, {layers}, {where})")
    return found


def test_imports_go_down_the_layers():
    """Every module has a layer, and imports only its own package and the layers below it."""
    assert direction_violations(project_modules()) == []


@pytest.mark.parametrize(
    ("module", "source", "imported"),
    [
        # rollout reaching what uses it
        (
            "rollout.engine.bad",
            "from trainers_adapters.grpo.loss import grpo_policy_loss\n",
            "trainers_adapters.grpo.loss",
        ),
        ("rollout.worker.bad", "import recipes.config\n", "recipes.config"),
        ("rollout.serve.bad", "from tests.families import FAMILIES\n", "tests.families"),
        # between the worker's features: up, and beside
        ("rollout.weights.bad", "from rollout.lora.manager import LoraManager\n", "rollout.lora.manager"),
        ("rollout.lora.bad", "from rollout.http.wire import tensors_to_bytes\n", "rollout.http.wire"),
        # the vocabulary reaching the pipelines (the loop there was)
        ("rollout.bad", "from rollout.pipelines.loading import load_adapter\n", "rollout.pipelines.loading"),
        # through the lazy public table, importlib and a registry's dotted path
        ("rollout.worker.bad", "from rollout import RemoteRolloutEngine\n", "rollout.serve.client"),
        (
            "rollout.worker.bad",
            "import importlib\nimportlib.import_module('rollout.serve.app')\n",
            "rollout.serve.app",
        ),
        ("rollout.pipelines.bad", "BACKENDS = {'mp': 'executors.mp:MpExecutor'}\n", "executors.mp"),
    ],
)
def test_a_wrong_way_import_is_named_with_both_modules(tmp_path, module, source, imported):
    modules = project_modules()
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    modules[module] = bad
    found = [line for line in direction_violations(modules) if line.startswith(f"{module} (")]
    assert len(found) == 1 and f" imports {imported} (" in found[0], found


def test_a_message_that_names_a_module_is_not_an_import(tmp_path):
    modules = project_modules()
    bad = tmp_path / "bad.py"
    bad.write_text('"""Unlike rollout.serve.app, this."""\nMESSAGE = "see rollout.serve.app for the routes"\n')
    modules["rollout.worker.bad"] = bad
    assert imported_modules("rollout.worker.bad", bad, modules) == set()
