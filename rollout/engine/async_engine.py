"""An asyncio front for `RolloutEngine`: many tasks submit requests, outputs stream back as they finish.

One thread owns the engine. It runs the calls that tasks queue for it (new requests, aborts, pauses,
weight updates, worker functions), each between two engine steps, and steps the engine whenever
requests are pending and it is not paused. Each finished output goes to the stream of the call that
asked for it, exactly once. No task steps the engine itself, and a stream closed early (a cancelled
task, a closed connection) aborts what it still waited for. The idea follows vLLM's `AsyncLLM`.

    engine = AsyncRolloutEngine(RolloutEngine(config))
    outputs = await engine.generate(["a red square"], SamplingParams(num_samples=4, seed=0))
    async for output in engine.generate_stream(prompts, params):
        ...
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from rollout.api import AsyncRolloutAPI, implements
from rollout.engine.rollout_engine import RolloutEngine
from rollout.engine.weight_sync import StagedPush
from rollout.errors import EngineDeadError, RequestFailedError
from rollout.outputs import RolloutOutput

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class OutputStream:
    """The outputs of one submission, as they finish: `async for output in stream`. `request_ids`
    lists its sample ids. Closing it early (`aclose`, or leaving an `async with` block) aborts the
    requests it still waits for. An engine failure ends it with the error; a request that failed
    alone in its worker raises `RequestFailedError` (closing the stream then aborts the others)."""

    def __init__(self, engine: AsyncRolloutEngine, request_ids: list[str], items: asyncio.Queue):
        self.request_ids = request_ids
        self._engine = engine
        self._items = items
        self._pending = set(request_ids)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RolloutOutput:
        if not self._pending:
            raise StopAsyncIteration
        item = await self._items.get()
        if isinstance(item, BaseException):
            self._pending.clear()
            raise item
        self._pending.discard(item.request_id)
        if item.status == "failed":
            raise RequestFailedError(item.request_id, item.error)
        return item

    async def aclose(self) -> None:
        """Abort the requests not yet delivered; their worker state is freed in the engine's thread."""
        if self._pending:
            pending, self._pending = list(self._pending), set()
            self._engine.abort_in_background(pending)

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def _between_steps(method: Callable) -> Callable:
    """A coroutine running `method` (a `RolloutEngine` method) on the engine in its thread, between
    two steps; same signature and docs."""

    @functools.wraps(method)
    async def call(self: AsyncRolloutEngine, *args, **kwargs):
        return await self._call(method, self.engine, *args, **kwargs)

    return call


def _streamed(method: Callable) -> Callable:
    """A coroutine running `method` (a `RolloutEngine` method that queues requests and returns
    their sample ids) on the engine in its thread, between two steps, that returns the stream of
    those samples' outputs; same parameters."""

    async def call(self: AsyncRolloutEngine, *args, **kwargs) -> OutputStream:
        return await self._open_stream(lambda: method(self.engine, *args, **kwargs))

    call.__name__ = call.__qualname__ = method.__name__
    call.__signature__ = inspect.signature(method).replace(return_annotation="OutputStream")
    call.__doc__ = f"`RolloutEngine.{method.__name__}`, returning the stream of the outputs of what it queues."
    return call


class AsyncRolloutEngine:
    """Every public method is a coroutine, safe to call from many tasks at once; hot-swap calls and
    `collective_rpc` take the arguments of `RolloutEngine`'s methods of the same name and run
    between two steps. Build it in the thread of the event loop that will use it."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Sink] = {}  # sample id -> where its output goes (engine thread only)
        self._paused = False
        self._draining: list[concurrent.futures.Future] = []  # pause("wait") calls waiting for the drain
        self._stopped = False
        self._failure: BaseException | None = None  # what ended the engine's thread, if not shutdown
        self._thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)
        self._thread.start()

    # Generation.

    add_requests = _streamed(RolloutEngine.add_requests)
    add_request = _streamed(RolloutEngine.add_request)

    @implements(AsyncRolloutAPI.generate)
    async def generate(self, prompts, params, *, images) -> list[RolloutOutput]:
        """`RolloutEngine.generate`, sharing batches with every other caller's requests; outputs
        ordered by prompt, then sample (aborted ones have status "aborted")."""
        async with await self.add_requests(prompts, params, images=images) as stream:
            outputs = {output.request_id: output async for output in stream}
        return [outputs[request_id] for request_id in stream.request_ids]

    @implements(AsyncRolloutAPI.generate_stream)
    async def generate_stream(self, prompts, params, *, images) -> AsyncIterator[RolloutOutput]:
        """Like `generate`, yielding each output as it finishes."""
        async with await self.add_requests(prompts, params, images=images) as stream:
            async for output in stream:
                yield output

    async def _open_stream(self, add: Callable, *args) -> OutputStream:
        sink = _Sink(asyncio.get_running_loop())
        added = self._submit(self._open, sink, add, *args)
        try:
            ids = await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            # The caller left while its requests were being added: abort them once they are.
            added.add_done_callback(lambda done: done.exception() or self.abort_in_background(done.result()))
            raise
        return OutputStream(self, ids, sink.items)

    def abort_in_background(self, request_ids: Sequence[str]) -> None:
        """Queue an abort of requests whose caller is gone, without waiting for it (a closing
        stream may be in a cancelled task, which cannot wait)."""
        if not self._stopped:
            self._submit(self._abort_quietly, list(request_ids))

    async def abort(self, request_ids: str | Iterable[str]) -> list[RolloutOutput]:
        """Abort by sample or group id; returns once the workers have freed the requests' state.
        Their streams get the aborted outputs too."""
        return await self._call(self._abort, request_ids)

    async def pause(self, mode: str = "abort") -> None:
        """Stop stepping: "abort" aborts every unfinished request; "wait" lets the running ones
        finish (waiting ones stay queued); "keep" holds the running ones where they are, and
        `resume()` continues them without losing progress. Returns once that has taken effect.
        New requests queue while paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        drained = await self._call(self._pause, mode)
        await asyncio.wrap_future(drained)

    async def resume(self) -> None:
        """Step again after `pause`."""
        await self._call(self._resume)

    async def fail_all(self, error: BaseException) -> None:
        """End every unfinished request now: its stream ends with `error` (not an aborted output),
        and its worker state is freed. For a server that is going away."""
        await self._call(self._fail_all, error)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine cannot serve, or None; read at once, not between two steps."""
        if self.engine.dead is not None:
            return self.engine.dead
        if self._failure is not None:
            return EngineDeadError(f"the engine's thread failed: {self._failure}")
        return None

    # The hot-swap API and worker functions, each between two steps: `RolloutEngine`'s methods of
    # the same names and signatures, run in the engine's thread.

    update_weights = _between_steps(RolloutEngine.update_weights)
    update_weights_from_disk = _between_steps(RolloutEngine.update_weights_from_disk)
    update_weights_from_worker = _between_steps(RolloutEngine.update_weights_from_worker)
    open_weight_push = _between_steps(RolloutEngine.open_weight_push)
    finish_weight_push = _between_steps(RolloutEngine.finish_weight_push)
    abort_weight_push = _between_steps(RolloutEngine.abort_weight_push)

    async def add_to_weight_push(self, push: StagedPush, named_tensors) -> None:
        """`push.add(named_tensors)` (a push from `open_weight_push`), between two steps: the
        engine steps on between the parts of a push that arrives over time."""
        await self._call(push.add, named_tensors)

    init_weight_update_group = _between_steps(RolloutEngine.init_weight_update_group)
    update_weights_from_distributed = _between_steps(RolloutEngine.update_weights_from_distributed)
    check_weight_update = _between_steps(RolloutEngine.check_weight_update)
    weights_checksum = _between_steps(RolloutEngine.weights_checksum)
    load_lora = _between_steps(RolloutEngine.load_lora)
    unload_lora = _between_steps(RolloutEngine.unload_lora)
    sleep = _between_steps(RolloutEngine.sleep)
    wake_up = _between_steps(RolloutEngine.wake_up)
    collective_rpc = _between_steps(RolloutEngine.collective_rpc)
    check_health = _between_steps(RolloutEngine.check_health)

    async def state(self) -> dict:
        """What a client needs to mirror the engine: weight version, adapters, sleep level, load.
        Raises EngineDeadError once the engine is dead."""
        engine = self.engine

        def read() -> dict:
            if engine.dead is not None:
                raise EngineDeadError(str(engine.dead))
            return {
                "weight_version": engine.weight_version,
                "loras": {name: engine.lora_modules(name) for name in engine.list_loras()},
                "sleep_level": engine.sleep_level,
                "paused": self._paused,
                "unfinished_requests": len(engine.unfinished_request_ids()),
                "running_requests": len(engine.unfinished_request_ids(running_only=True)),
            }

        return await self._call(read)

    # Lifetime.

    def shutdown(self) -> None:
        """Stop the engine's thread (after the call it runs) and the engine; open streams fail."""
        if not self._stopped:
            self._stopped = True
            self._calls.put(None)
            self._thread.join()
            self.engine.shutdown()

    # The engine's thread.

    async def _call(self, fn: Callable, *args, **kwargs) -> Any:
        return await asyncio.wrap_future(self._submit(fn, *args, **kwargs))

    def _submit(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        if self._failure is not None:
            raise RuntimeError(f"this AsyncRolloutEngine's thread failed ({self._failure!r}); create a new one")
        if self._stopped:
            raise RuntimeError("this AsyncRolloutEngine is shut down; create a new one")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as error:  # a fault in this loop itself: fail everyone rather than leave them waiting
            logger.exception("the AsyncRolloutEngine's thread failed; failing every stream and queued call")
            self._failure = error
            failure = RuntimeError(f"the AsyncRolloutEngine's thread failed: {error!r}")
            self._fail_streams(failure)
            self._fail_queued_calls(failure)
            return
        self._fail_streams(RuntimeError("the AsyncRolloutEngine shut down"))

    def _fail_queued_calls(self, error: BaseException) -> None:
        for future in self._draining:
            if not future.done():
                future.set_exception(error)
        while True:
            try:
                call = self._calls.get(block=False)
            except queue.Empty:
                return
            if call is not None and call[0].set_running_or_notify_cancel():
                call[0].set_exception(error)

    def _serve(self) -> None:
        while True:
            stepping = self._wants_step()
            try:
                call = self._calls.get(block=not stepping)
            except queue.Empty:
                self._step()
                continue
            if call is None:
                break
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # goes to the caller
                future.set_exception(error)
            self._after_engine_call()

    def _wants_step(self) -> bool:
        if self.engine.dead is not None:
            return False
        if self._paused:
            return bool(self._draining) and bool(self.engine.unfinished_request_ids(running_only=True))
        return self.engine.has_unfinished_requests()

    def _step(self) -> None:
        try:
            self._deliver(self.engine.step(admit=not self._paused))
        except Exception as error:
            self._step_failed(error)
        self._after_engine_call()

    def _after_engine_call(self) -> None:
        """Deliver what finished outside a step, fail every stream if the engine died, and answer
        pause("wait") calls once the running requests are done."""
        if self.engine.dead is not None:
            self._fail_streams(EngineDeadError(str(self.engine.dead)))
        else:
            self._deliver(self.engine.take_finished())
        if self._draining and (
            self.engine.dead is not None or not self.engine.unfinished_request_ids(running_only=True)
        ):
            self._end_drains()

    def _step_failed(self, error: Exception) -> None:
        if self.engine.dead is not None:
            return  # _after_engine_call fails every stream
        # A worker raised inside a step: its batch's state is unknown, so end every request with the error.
        logger.error("an engine step failed; failing %d requests: %s", len(self._streams), error)
        self._fail_all(error)

    def _open(self, sink: _Sink, add: Callable, *args) -> list[str]:
        ids = add(*args)
        for request_id in ids:
            self._streams[request_id] = sink
        return ids

    def _deliver(self, outputs: list[RolloutOutput]) -> None:
        for output in outputs:
            sink = self._streams.pop(output.request_id, None)
            if sink is not None:  # None: its stream was closed and it aborted
                sink.put(output)

    def _abort(self, request_ids) -> list[RolloutOutput]:
        aborted = self.engine.abort(request_ids)
        self._deliver(aborted)
        return aborted

    def _abort_quietly(self, request_ids: list[str]) -> None:
        """Abort requests whose stream is gone (a closed stream, a failed step)."""
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        if self.engine.dead is None:
            try:
                self.engine.abort(request_ids)
            except Exception as error:  # the engine is failing anyway; the streams are told
                logger.warning("could not abort %d requests: %s", len(request_ids), error)

    def _fail_all(self, error: BaseException) -> None:
        self._fail_streams(error)
        self._abort_quietly(self.engine.unfinished_request_ids())

    def _pause(self, mode: str) -> concurrent.futures.Future:
        """Returns a future that completes when the pause has taken effect."""
        self._paused = True
        drained: concurrent.futures.Future = concurrent.futures.Future()
        if mode == "abort":
            self._abort(self.engine.unfinished_request_ids())
        if mode == "wait":
            self._draining.append(drained)  # completed by _after_engine_call
        else:
            drained.set_result(None)
        return drained

    def _resume(self) -> None:
        self._paused = False
        self._end_drains()  # a resume ends a drain early: nothing is paused any more

    def _end_drains(self) -> None:
        for future in self._draining:
            if not future.cancelled():  # cancelled: its caller stopped waiting (a timeout around pause)
                future.set_result(None)
        self._draining = []

    def _fail_streams(self, error: BaseException) -> None:
        for sink in set(self._streams.values()):
            sink.put(error)
        self._streams.clear()


class _Sink:
    """Where the engine's thread puts one stream's outputs (and a final error) for its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()

    def put(self, item: RolloutOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is left to read the stream
            logger.debug("dropped an item for a stream whose event loop is closed")
