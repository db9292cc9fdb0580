"""AsyncRolloutEngine: concurrent callers share the engine, every output reaches its caller once,
aborts are acknowledged, pauses take effect, and hot swaps run between steps."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.engine.async_engine import AsyncRolloutEngine
from rollout.errors import RequestFailedError
from tests.executors.worker_functions import slow_down_steps

pytestmark = pytest.mark.timeout(180)

PARAMS = SamplingParams(num_inference_steps=4, num_samples=2, seed=5)


@pytest.fixture
def async_engine(tiny_model):
    engine = AsyncRolloutEngine(RolloutEngine(EngineConfig(model=tiny_model, max_batch_size=8)))
    yield engine
    engine.shutdown()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=120))


def _close(a, b) -> bool:
    return a.seed == b.seed and torch.allclose(a.trajectory.latents.stack(), b.trajectory.latents.stack(), atol=1e-4)


def test_generate_matches_the_sync_engine_bitwise(async_engine, engine):
    expected = engine.generate(["red", "blue"], PARAMS)
    got = run(async_engine.generate(["red", "blue"], PARAMS))
    assert [o.request_id for o in got] == [o.request_id for o in expected]
    assert all(
        torch.equal(a.trajectory.latents.stack(), b.trajectory.latents.stack())
        for a, b in zip(got, expected, strict=True)
    )
    assert all(torch.equal(a.image, b.image) for a, b in zip(got, expected, strict=True))


def test_concurrent_callers_each_get_their_outputs_once(async_engine, engine):
    expected = {f"p{i}": engine.generate([f"p{i}"], PARAMS) for i in range(6)}  # each alone: prompt_index 0

    async def main():
        async def one_caller(index):
            outputs = []
            async for output in async_engine.generate_stream([f"p{index}"], PARAMS):
                outputs.append(output)
            return outputs

        results = await asyncio.gather(*(one_caller(i) for i in range(6)))
        return results, await async_engine.state()

    results, state = run(main())
    for index, outputs in enumerate(results):
        assert sorted(o.sample_index for o in outputs) == [0, 1]  # each sample exactly once
        assert all(o.prompt == f"p{index}" and o.status == "finished" for o in outputs)
        # Batched with other callers' requests: the same samples, up to float sums in a larger batch.
        outputs.sort(key=lambda o: o.sample_index)
        assert all(_close(a, b) for a, b in zip(outputs, expected[f"p{index}"], strict=True))
    assert state["unfinished_requests"] == 0 and async_engine.engine.collective_rpc("request_ids") == [[]]


def test_abort_returns_after_the_worker_freed_the_state(async_engine):
    async def main():
        await async_engine.collective_rpc(slow_down_steps, args=(0.05,))
        stream = await async_engine.add_requests(["slow"], SamplingParams(num_inference_steps=50, num_samples=3))
        await asyncio.sleep(0.3)  # some steps in
        aborted = await async_engine.abort([stream.request_ids[0].rpartition("-")[0]])
        live = await async_engine.collective_rpc("request_ids")
        streamed = [output async for output in stream]
        return aborted, live, streamed

    aborted, live, streamed = run(main())
    assert [o.status for o in aborted] == ["aborted"] * 3
    assert live == [[]]
    assert sorted(o.request_id for o in streamed) == sorted(o.request_id for o in aborted)


def test_pause_keep_holds_progress_and_resume_continues_to_the_same_result(async_engine, engine):
    params = SamplingParams(num_inference_steps=12, num_samples=2, seed=9)
    expected = engine.generate(["kept"], params)

    async def main():
        await async_engine.collective_rpc(slow_down_steps, args=(0.02,))
        stream = await async_engine.add_requests(["kept"], params)
        await asyncio.sleep(0.1)
        await async_engine.pause("keep")
        progress = [r.steps_done for r in async_engine.engine.scheduler.running.values()]
        await asyncio.sleep(0.3)
        still = [r.steps_done for r in async_engine.engine.scheduler.running.values()]
        await async_engine.resume()
        return progress, still, [output async for output in stream]

    progress, still, outputs = run(main())
    assert progress == still and all(0 < done < 12 for done in progress)  # held mid-way, not restarted
    outputs.sort(key=lambda o: o.sample_index)
    assert all(
        torch.equal(a.trajectory.latents.stack(), b.trajectory.latents.stack())
        for a, b in zip(outputs, expected, strict=True)
    )


def test_pause_wait_finishes_running_and_holds_waiting(tiny_model):
    engine = AsyncRolloutEngine(RolloutEngine(EngineConfig(model=tiny_model, max_batch_size=2)))

    async def main():
        running = await engine.add_requests(["first"], SamplingParams(num_inference_steps=6, num_samples=2))
        while (await engine.state())["running_requests"] < 2:  # admitted by a step (a busy machine is slow)
            await asyncio.sleep(0.01)
        waiting = await engine.add_requests(["second"], SamplingParams(num_inference_steps=6, num_samples=2))
        await engine.pause("wait")
        first = [output async for output in running]
        state = await engine.state()
        await engine.resume()
        second = [output async for output in waiting]
        return first, state, second

    try:
        first, state, second = run(main())
    finally:
        engine.shutdown()
    assert [o.status for o in first] == ["finished"] * 2
    assert state["paused"] and state["unfinished_requests"] == 2  # the second prompt stayed queued
    assert [o.status for o in second] == ["finished"] * 2


def test_pause_abort_ends_everything_and_new_requests_wait_for_resume(async_engine):
    async def main():
        stream = await async_engine.add_requests(["a", "b"], SamplingParams(num_inference_steps=30))
        await async_engine.pause("abort")
        aborted = [output async for output in stream]
        later = asyncio.ensure_future(async_engine.generate(["c"], PARAMS))
        await asyncio.sleep(0.2)
        held = not later.done()
        await async_engine.resume()
        return aborted, held, await later

    aborted, held, later = run(main())
    assert [o.status for o in aborted] == ["aborted", "aborted"]
    assert held and [o.status for o in later] == ["finished", "finished"]


def test_weight_update_during_requests_runs_between_steps(async_engine):
    state = async_engine.engine.collective_rpc("weight_specs", args=("transformer",))[0]
    assert state
    transformer = {name: torch.zeros(spec.shape, dtype=spec.dtype) for name, spec in state.items()}

    async def main():
        await async_engine.collective_rpc(slow_down_steps, args=(0.01,))
        stream = await async_engine.add_requests(["x"], SamplingParams(num_inference_steps=10, num_samples=2))
        await asyncio.sleep(0.05)
        version = await async_engine.update_weights(transformer, mode="pause")
        return version, [output async for output in stream]

    version, outputs = run(main())
    assert version == 1
    assert all(o.weight_versions == (0, 1) for o in outputs)  # started on 0, finished on 1


def test_a_closed_stream_aborts_its_requests(async_engine):
    async def main():
        stream = await async_engine.add_requests(["gone"], SamplingParams(num_inference_steps=40, num_samples=2))
        await stream.aclose()
        await asyncio.sleep(0.1)
        return await async_engine.state(), await async_engine.collective_rpc("request_ids")

    state, live = run(main())
    assert state["unfinished_requests"] == 0 and live == [[]]


def test_bad_requests_raise_to_their_caller_and_others_go_on(async_engine):
    async def main():
        with pytest.raises(ValueError, match="height=33"):
            await async_engine.generate(["bad"], SamplingParams(height=33))
        with pytest.raises(ValueError, match="pause mode"):
            await async_engine.pause("sometimes")
        return await async_engine.generate(["good"], PARAMS)

    assert [o.status for o in run(main())] == ["finished", "finished"]


def _fail_steps_of(worker, prompt: str) -> None:
    """From now on, a step of a batch holding a request for `prompt` raises (as a shape the model
    cannot take would), in its forward pass: nothing of the batch has moved."""
    step = worker.runner.step

    def failing_step(states):
        if any(state.data.prompt == prompt for state in states):
            raise RuntimeError(f"injected failure for {prompt!r}")
        step(states)

    worker.runner.step = failing_step


def _restore_step(worker) -> None:
    vars(worker.runner).pop("step", None)


def test_a_request_that_fails_in_its_worker_fails_alone_and_its_batch_mates_go_on(async_engine):
    """The worker steps the failed batch's requests one by one: the doomed one fails (its whole
    generate, which leaves nothing behind), the one batched with it finishes as if it ran alone."""

    one = dataclasses.replace(PARAMS, num_samples=1)

    async def main():
        (alone,) = await async_engine.generate(["fine"], one)
        await async_engine.collective_rpc(_fail_steps_of, args=("doomed",))
        doomed = asyncio.ensure_future(async_engine.generate(["doomed"], one))
        fine = asyncio.ensure_future(async_engine.generate(["fine"], one))  # shares doomed's batch
        with pytest.raises(RequestFailedError, match="request req.-0 failed in a worker, alone.*injected failure"):
            await doomed
        (together,) = await fine
        with pytest.raises(RequestFailedError):
            await async_engine.generate(["doomed", "also mine"], PARAMS)  # its whole call fails
        state = await async_engine.state()
        live = await async_engine.collective_rpc("request_ids")
        await async_engine.collective_rpc(_restore_step)
        return alone, together, state, live, await async_engine.generate(["fine"], PARAMS)

    alone, together, state, live, after = run(main())
    assert together.status == "finished"
    assert torch.equal(alone.trajectory.latents.stack(), together.trajectory.latents.stack())
    assert torch.equal(alone.image, together.image)
    assert state["unfinished_requests"] == 0 and live == [[]]  # "also mine" was aborted with its call
    assert [o.status for o in after] == ["finished", "finished"]


def test_fail_all_ends_every_stream_with_the_error_and_frees_the_workers(async_engine):
    async def main():
        await async_engine.collective_rpc(slow_down_steps, args=(0.05,))
        running = await async_engine.add_requests(["a"], SamplingParams(num_inference_steps=200, num_samples=2))
        queued = await async_engine.add_requests(["b"], SamplingParams(num_inference_steps=200, num_samples=8))
        await asyncio.sleep(0.3)
        await async_engine.fail_all(RuntimeError("going away"))
        for stream in (running, queued):
            with pytest.raises(RuntimeError, match="going away"):
                await anext(stream)
        return await async_engine.state(), await async_engine.collective_rpc("request_ids")

    state, live = run(main())
    assert state["unfinished_requests"] == 0 and live == [[]]


def test_a_pause_wait_whose_caller_stops_waiting_leaves_the_engine_serving(async_engine):
    """wait_for() around pause("wait") cancels the drain its caller waited for; the engine thread
    must not trip over it when the drain ends (it raised InvalidStateError there)."""

    async def main():
        await async_engine.collective_rpc(slow_down_steps, args=(0.05,))
        stream = await async_engine.add_requests(["a"], SamplingParams(num_inference_steps=20, num_samples=1))
        await asyncio.sleep(0.2)  # running
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(async_engine.pause("wait"), 0.1)
        finished = [output async for output in stream]  # the drain runs on and ends
        await async_engine.resume()
        return finished, await async_engine.generate(["b"], SamplingParams(num_inference_steps=2))

    finished, after = run(main())
    assert [o.status for o in finished] == ["finished"] and [o.status for o in after] == ["finished"]


def test_a_fault_in_the_engine_thread_fails_its_callers_instead_of_leaving_them_waiting(async_engine, monkeypatch):
    def faulty() -> bool:
        raise RuntimeError("a fault")

    async def main():
        stream = await async_engine.add_requests(["a"], SamplingParams(num_inference_steps=50))
        monkeypatch.setattr(async_engine, "_wants_step", faulty)  # the thread's next turn meets it
        with pytest.raises(RuntimeError, match=r"thread failed: RuntimeError\('a fault'\)"):
            await anext(stream)
        with pytest.raises(RuntimeError, match="thread failed .* create a new one"):
            await async_engine.state()

    run(main())
