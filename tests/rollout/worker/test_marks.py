"""Every worker function of the worker's own says what it does with one mark
(`rollout.worker.marks`), and what the engine and the service do with it derives from the marks."""

from rollout.worker.marks import ENGINE_ROUTE, READ_ONLY, STEP, engine_routes, mark_of, worker_functions
from rollout.worker.worker import _KEEP_THE_MERGE, READ_ONLY_METHODS, Worker


def test_every_public_worker_method_carries_a_mark():
    unmarked = sorted(name for name in worker_functions(Worker) if mark_of(getattr(Worker, name)) is None)
    assert unmarked == []


def test_the_name_lists_derive_from_the_marks():
    marks = {name: mark_of(getattr(Worker, name)) for name in worker_functions(Worker)}
    assert {name for name, mark in marks.items() if mark == READ_ONLY} == READ_ONLY_METHODS
    assert _KEEP_THE_MERGE == READ_ONLY_METHODS | {"execute"}
    assert {name for name, mark in marks.items() if mark == STEP} == {"execute"}
    routed = {name for name, mark in marks.items() if mark in (STEP, ENGINE_ROUTE)}
    assert set(engine_routes(Worker)) == routed
    assert engine_routes(Worker)["execute"] == "generate"
    assert engine_routes(Worker)["commit_lora"] == "load_lora"


def test_every_route_is_an_engine_method():
    from rollout.api import RolloutAPI

    assert [route for route in engine_routes(Worker).values() if route not in vars(RolloutAPI)] == []
