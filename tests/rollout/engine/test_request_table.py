"""The scheduler's request table: its indexes answer what a scan of every request would, through
queueing, branching, finishing and aborting, and the engine's bookkeeping does not grow with the
queue."""

from __future__ import annotations

import time

import pytest

from rollout import EngineConfig, NodeId, RolloutEngine, SamplingParams
from rollout.engine.request import Request
from rollout.engine.scheduler import Scheduler

pytestmark = pytest.mark.timeout(120)


def _request(group: str, sample: int, branch_steps=(), branch_factor=2) -> Request:
    params = SamplingParams(num_inference_steps=4, branch_steps=branch_steps, branch_factor=branch_factor)
    return Request(
        node_id=NodeId(group, sample),
        prompt="p",
        prompt_index=0,
        params=params,
        seed=0,
        init_noise_seed=0,
        base_seed=0,
        tree_id=0,
    )


def _scan_matching(table: Scheduler, target: str) -> list[str]:
    return [
        r.request_id for r in table.requests.values() if target in (r.request_id, r.group_id) or target in r.ancestors
    ]


def test_indexes_agree_with_a_scan_through_branching_finishing_and_aborting():
    table = Scheduler(num_ranks=2, max_batch_size=8)
    for group in ("a", "b"):
        for sample in range(2):
            table.add(_request(group, sample, branch_steps=(0, 1)))
    table.add(_request("c", 0))
    targets = ["a", "b", "c", "a-0", "a-1", "b-0", "c-0", "a-0.0", "a-0.1", "b-1.1", "a-0.0.1", "zz"]
    for _ in range(3):  # admit, branch twice
        table.schedule()
        for target in targets:
            assert [r.request_id for r in table.matching(target)] == _scan_matching(table, target)
    assert sorted(table.requests) == sorted([*table.waiting, *table.running])
    assert len(table.requests) == 4 * 4 + 1 and table.is_live_id("a-0") and table.is_live_group("b")
    assert "c-0" in table.waiting  # both ranks are full
    table.abort("c-0")
    assert not table.is_live_group("c") and table.matching("c") == [] and not table.waiting
    table.finish("b-1.1.1")
    assert [r.request_id for r in table.matching("b-1.1")] == ["b-1.1.0"]
    for request in table.matching("a-0.1"):
        table.abort(request.request_id)
    assert [r.request_id for r in table.matching("a-0")] == ["a-0.0.0", "a-0.0.1"]
    for request in table.matching("a"):
        table.abort(request.request_id)
    assert not table.is_live_group("a") and not table.is_live_id("a-0") and not table.is_live_id("a-1.0")
    assert table.abort_all() and not table.requests and not table.is_live_group("b")


def test_a_future_branch_is_found_through_its_nearest_live_parent():
    table = Scheduler(num_ranks=1, max_batch_size=8)
    table.add(_request("a", 0, branch_steps=(1, 2), branch_factor=3))
    assert table.future_parent(NodeId.parse("a-0.2.1")).request_id == "a-0"
    assert table.future_parent(NodeId.parse("a-0.3")) is None  # no child 3 with a branch factor of 3
    assert table.future_parent(NodeId.parse("a-0.1.1.1")) is None  # deeper than its branch steps
    assert table.future_parent(NodeId("a", 0)) is None and table.future_parent(NodeId.parse("b-0.1")) is None


def test_adding_and_aborting_cost_the_same_with_a_long_queue(tiny_model):
    """The cost of one add_request, and of aborting per request, with 16x more queued stays within
    a small factor of the short queue's (a scan of the table per call made them grow 16x and 256x)."""
    params = SamplingParams(num_inference_steps=2, seed=0)

    def per_call(engine, queued: int) -> tuple[float, float]:
        ids = [engine.add_request("x", params)[0] for _ in range(queued)]
        start = time.perf_counter()
        ids += [engine.add_request("x", params)[0] for _ in range(100)]
        add = (time.perf_counter() - start) / 100
        start = time.perf_counter()
        engine.abort(ids)
        return add, (time.perf_counter() - start) / len(ids)

    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        per_call(engine, 100)  # warm up
        short = [min(times) for times in zip(*(per_call(engine, 200) for _ in range(3)), strict=True)]
        long = [min(times) for times in zip(*(per_call(engine, 3200) for _ in range(2)), strict=True)]
    assert long[0] < 4 * short[0], f"add_request: {short[0]:.2e} s with 200 queued, {long[0]:.2e} s with 3200"
    assert long[1] < 4 * short[1], f"abort: {short[1]:.2e} s per request with 200 queued, {long[1]:.2e} s with 3200"
