"""Aborted requests end with status "aborted" and leave nothing behind."""

from __future__ import annotations

import pytest

from rollout import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _assert_no_state(engine):
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.scheduler.take_frees().is_empty
    assert engine.scheduler.requests == {}
    assert engine.collective_rpc("request_ids") == [[]]


def test_many_aborts_leave_no_state(engine):
    params = SamplingParams(num_inference_steps=5, num_samples=3, seed=0)
    for round_index in range(20):
        ids = engine.add_request(f"prompt {round_index}", params, request_id=f"r{round_index}")
        for _ in range(round_index % 4):  # abort while waiting, and after 1-3 steps
            engine.step()
        if round_index % 2:
            aborted = engine.abort(f"r{round_index}")  # the whole group by its id
        else:
            aborted = engine.abort(ids)
        assert sorted(o.request_id for o in aborted) == sorted(ids)
        assert all(o.status == "aborted" and o.image is None and o.trajectory is None for o in aborted)
        _assert_no_state(engine)


def test_abort_one_of_several_running(engine):
    params = SamplingParams(num_inference_steps=3, seed=1)
    keep = engine.add_request("keep", params, request_id="keep")
    drop = engine.add_request("drop", params, request_id="drop")
    engine.step()
    assert engine.collective_rpc("request_ids") == [sorted(keep + drop)]
    engine.abort(drop)
    assert engine.collective_rpc("request_ids") == [keep]  # freed at once, not at the next step
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == keep and outputs[0].status == "finished"
    _assert_no_state(engine)


def test_abort_unknown_or_finished_id_is_a_no_op(engine):
    (done,) = engine.generate("x", SamplingParams(num_inference_steps=1, seed=0))
    assert engine.abort([done.request_id, "never-added"]) == []
    _assert_no_state(engine)


def test_outputs_parked_by_a_waiting_update_survive_a_generate(engine):
    """Requests that finish while an update waits for them come from the next step(), even when a
    generate() runs in between (it used to take them and return only its own)."""
    from rollout.weights.state import base_state

    state = engine.collective_rpc(
        lambda worker: {n: t.clone() for n, t in base_state(worker.adapter.transformer).items()}
    )[0]
    ids = engine.add_request("parked", SamplingParams(num_inference_steps=3, num_samples=2, seed=0), request_id="p")
    engine.step()
    engine.update_weights(state, mode="wait")  # runs "p" to the end and parks its outputs
    assert not engine.has_unfinished_requests()
    (own,) = engine.generate("own", SamplingParams(num_inference_steps=2, seed=1))
    assert own.prompt == "own"
    assert sorted(o.request_id for o in engine.step()) == sorted(ids)
    assert engine.step() == []


def test_the_ids_the_engine_makes_are_not_a_caller_s_to_take(engine):
    """A caller that took "req<n>", the id the engine gives the next request without one, made that
    request (another client's, behind a server) fail as a clash: the engine's ids are its own."""
    params = SamplingParams(num_inference_steps=3, seed=0)
    (made,) = engine.add_request("x", params)
    number = int(made.removeprefix("req").removesuffix("-0"))
    for taken in (f"req{number + 1}", f"req{number + 1}-0", "req0"):
        with pytest.raises(ValueError, match=f"request_id {taken!r} has the form of an id the engine makes"):
            engine.add_request("y", params, request_id=taken)
    assert engine.add_request("z", params) == [f"req{number + 1}-0"]
    assert engine.add_request("z", params, request_id="req") == ["req-0"]  # not a number: the caller's
    engine.abort(engine.unfinished_request_ids())
    _assert_no_state(engine)


def test_group_and_sample_ids_cannot_be_confused(engine):
    """abort() takes sample ids and group ids, so an id that would name both is refused at once."""
    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=0)
    ids = engine.add_request("x", params, request_id="a")
    assert ids == ["a-0", "a-1"]
    engine.add_request("y", params, request_id="c-0")  # its group id is a sample id of group "c"
    for clashing in ("a", "a-1", "c"):
        with pytest.raises(ValueError, match=f"request_id {clashing!r} is refused"):
            engine.add_request("z", params, request_id=clashing)
    assert sorted(o.request_id for o in engine.abort("a")) == ["a-0", "a-1"]
    assert sorted(o.request_id for o in engine.abort("c-0")) == ["c-0-0", "c-0-1"]
    _assert_no_state(engine)
    assert engine.add_request("z", params, request_id="a-1") == ["a-1-0", "a-1-1"]  # free again
    engine.abort("a-1")
