"""The three fronts against the one declared API (rollout.api), and the route table against the
server and the client."""

from __future__ import annotations

import inspect

import pytest

from rollout.api import AsyncRolloutAPI, RolloutAPI
from rollout.engine.async_engine import AsyncRolloutEngine
from rollout.engine.rollout_engine import RolloutEngine
from rollout.serve.client import RemoteRolloutEngine
from rollout.serve.routes import ROUTES

pytestmark = pytest.mark.timeout(60)


def _declared(protocol) -> dict:
    """The protocol's own members: name -> function or property."""
    return {
        name: member
        for name, member in vars(protocol).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }


def _conforms(implementation, name: str, declared) -> list[str]:
    """How `implementation.name` differs from its declaration: an implementation may add
    keyword-only parameters with defaults, nothing else."""
    member = inspect.getattr_static(implementation, name, None)
    if member is None:
        return [f"{implementation.__name__} lacks {name}"]
    if isinstance(declared, property):
        return [] if isinstance(member, property) else [f"{implementation.__name__}.{name} is not a property"]
    member = getattr(implementation, name)
    problems = []
    if inspect.iscoroutinefunction(declared) != inspect.iscoroutinefunction(member):
        problems.append(f"{implementation.__name__}.{name}: coroutine or not, unlike its declaration")
    want, got = inspect.signature(declared), inspect.signature(member)
    extra = [p for p in got.parameters.values() if p.name not in want.parameters]
    kept = got.replace(parameters=[p for p in got.parameters.values() if p.name in want.parameters])
    if kept != want:
        problems.append(f"{implementation.__name__}.{name}{got} is not {name}{want}")
    if any(p.kind is not p.KEYWORD_ONLY or p.default is p.empty for p in extra):
        problems.append(f"{implementation.__name__}.{name} adds parameters that are not keyword-only with defaults")
    return problems


@pytest.mark.parametrize(
    ("implementation", "protocol"),
    [(RolloutEngine, RolloutAPI), (RemoteRolloutEngine, RolloutAPI), (AsyncRolloutEngine, AsyncRolloutAPI)],
    ids=["RolloutEngine", "RemoteRolloutEngine", "AsyncRolloutEngine"],
)
def test_each_front_conforms_to_the_declared_api(implementation, protocol):
    declared = _declared(protocol)
    assert len(declared) > 15
    problems = [problem for name, member in declared.items() for problem in _conforms(implementation, name, member)]
    assert problems == []


def test_the_checker_sees_a_wrong_signature():
    class Wrong:
        def abort(self, request_ids, now=True): ...  # a positional extra

        async def sleep(self, level: int = 2) -> None: ...  # a coroutine, another default

    assert _conforms(Wrong, "abort", RolloutAPI.abort)
    assert len(_conforms(Wrong, "sleep", RolloutAPI.sleep)) == 2
    assert _conforms(Wrong, "wake_up", RolloutAPI.wake_up) == ["Wrong lacks wake_up"]


def test_route_bodies_take_the_api_defaults():
    """A field a route's body shares with its API method has the method's default (one default)."""
    checked = 0
    for name, route in ROUTES.items():
        method = getattr(RolloutAPI, name.removesuffix("_tensors"), None)
        if route.body is None or method is None:
            continue
        for parameter in inspect.signature(method).parameters.values():
            field = route.body.model_fields.get(parameter.name)
            if field is not None and parameter.default is not parameter.empty:
                default = list(parameter.default) if isinstance(parameter.default, tuple) else parameter.default
                assert field.default == default, (name, parameter.name)  # as JSON: a tuple is a list
                checked += 1
    assert checked >= 15


def test_the_server_mounts_exactly_the_route_table(tiny_model):
    from rollout import EngineConfig
    from rollout.serve.app import ServerSettings, build_app

    engine = AsyncRolloutEngine(RolloutEngine(EngineConfig(model=tiny_model)))
    try:
        app = build_app(engine, ServerSettings())
    finally:
        engine.shutdown()
    # The schema lists every route but its own pages (/openapi.json and /docs).
    served = {(method.upper(), path) for path, item in app.openapi()["paths"].items() for method in item}
    assert served == {(route.method, route.path) for route in ROUTES.values()}


def test_the_public_table_names_each_object_where_it_lives_and_import_rollout_loads_nothing():
    import subprocess
    import sys

    import rollout

    for name in rollout.__all__:
        value = getattr(rollout, name)
        assert value.__name__ == name and value.__module__ == rollout.PUBLIC_NAMES[name], name
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        rollout.Engine  # noqa: B018
    script = (
        "import sys, rollout\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'diffusers', 'fastapi'}))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_the_type_checkers_imports_are_the_public_table():
    """rollout/__init__.py imports each public name under TYPE_CHECKING (for IDEs and type
    checkers, never at run time) from the module its lazy table names, as `X as X` (a re-export)."""
    import ast

    import rollout

    tree = ast.parse(inspect.getsource(rollout))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {
        alias.asname: node.module
        for node in block.body
        for alias in node.names
        if isinstance(node, ast.ImportFrom) and alias.asname == alias.name
    }
    assert len(block.body) == len(imported) == len(rollout.PUBLIC_NAMES)
    assert imported == rollout.PUBLIC_NAMES


def test_a_client_call_binds_its_arguments_as_declared_before_sending():
    class Recorder:
        def _call(self, route, **fields):
            self.sent = (route, fields)

        sleep = RemoteRolloutEngine.sleep
        init_weight_update_group = RemoteRolloutEngine.init_weight_update_group

    client = Recorder()
    client.sleep()
    assert client.sent == ("sleep", {"level": 1})  # the declared default
    client.init_weight_update_group("h", 1, 1, 2, timeout_s=5.0)
    assert client.sent[1] == {
        "master_address": "h",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
        "timeout_s": 5.0,
    }
    del client.sent
    with pytest.raises(TypeError, match="lvl"):
        client.sleep(lvl=2)
    assert not hasattr(client, "sent")  # nothing was sent


_FRONTS = [
    (RolloutEngine, "rollout/engine/rollout_engine.py"),
    (AsyncRolloutEngine, "rollout/engine/async_engine.py"),
    (RemoteRolloutEngine, "rollout/serve/client.py"),
    (RolloutAPI, "rollout/api.py"),
    (AsyncRolloutAPI, "rollout/api.py"),
]


def _not_written_out(front, source: str) -> list[str]:
    """The public members of `front` that are made at import (a wrapper, a copied signature) or
    defined outside `source`, or that have no docstring."""
    problems = []
    for name, member in vars(front).items():
        function = member.fget if isinstance(member, property) else member
        if name.startswith("_") or not inspect.isfunction(function):
            continue
        where = (function.__qualname__, function.__code__.co_filename.replace("\\", "/"))
        if where[0] != f"{front.__qualname__}.{name}" or not where[1].endswith(source):
            problems.append(f"{front.__name__}.{name} is made by {where}")
        if "__signature__" in vars(function) or "__wrapped__" in vars(function):
            problems.append(f"{front.__name__}.{name} carries a signature not its own")
        if not (function.__doc__ or "").strip():
            problems.append(f"{front.__name__}.{name} has no docstring")
    return problems


@pytest.mark.parametrize(("front", "source"), _FRONTS, ids=[front.__name__ for front, _ in _FRONTS])
def test_every_front_member_is_written_out_in_its_class_with_a_docstring(front, source):
    """An IDE's "go to definition" and a static call graph land on each member's own code, which
    says what it does."""
    assert _not_written_out(front, source) == []


def test_the_written_out_check_sees_made_members():
    import functools

    def made(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            return method(self, *args, **kwargs)

        return call

    class Front:
        sleep = made(RolloutEngine.sleep)  # a wrapper: its code is the decorator's

        def wake_up(self) -> None: ...  # no docstring

        def check_health(self) -> None:
            """Fine."""

    Front.check_health.__signature__ = inspect.signature(RolloutAPI.check_health)
    problems = _not_written_out(Front, "tests/test_api.py")
    assert [p.split(" ")[0] for p in problems] == ["Front.sleep", "Front.sleep", "Front.wake_up", "Front.check_health"]


def test_the_async_twins_take_the_arguments_of_the_calls_they_run():
    """`AsyncRolloutAPI`'s coroutines are `RolloutAPI`'s calls, and `AsyncRolloutEngine`'s are
    `RolloutEngine`'s methods of the same names run in its thread: written twice, held equal."""
    streamed = {"add_request", "add_requests"}  # these return the stream of what they queue
    checked = 0
    for twin, sync in [(AsyncRolloutAPI, RolloutAPI), (AsyncRolloutEngine, RolloutEngine)]:
        for name, member in vars(twin).items():
            # generate has no progress bar (use_tqdm) in the async twin: declared on its own.
            if name == "generate" or not inspect.iscoroutinefunction(member) or name not in vars(sync):
                continue
            want, got = inspect.signature(getattr(sync, name)), inspect.signature(member)
            if name in streamed:
                want = want.replace(return_annotation="OutputStream")
            assert got == want, f"{twin.__name__}.{name}{got} is not {sync.__name__}.{name}{want}"
            checked += 1
    assert checked >= 14 + 19


def test_an_implementation_takes_the_declared_signature_and_must_list_its_names():
    from rollout.api import implements

    @implements(RolloutAPI.sleep)
    def sleep(self, level):
        return level

    assert inspect.signature(sleep) == inspect.signature(RolloutAPI.sleep)
    assert sleep(None) == 1 and sleep(None, level=2) == 2  # the declared default
    with pytest.raises(TypeError, match="lvl"):
        sleep(None, lvl=2)
    with pytest.raises(TypeError, match="does not list"):
        implements(RolloutAPI.sleep)(lambda self, lvl: None)


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("rollout.engine", "RolloutEngine", "rollout.engine.rollout_engine"),
        ("rollout.weights", "checksum", "rollout.weights.state"),
        ("rollout.lora", "adapter_to_float32", "rollout.lora.manager"),
        ("rollout.worker", "call_function", "rollout.worker.worker"),
    ],
)
def test_a_name_of_a_module_that_became_a_package_resolves_for_a_release_and_says_where_it_went(old, name, new):
    import importlib

    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new}\.{name}"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        importlib.import_module(old).no_such_name  # noqa: B018
