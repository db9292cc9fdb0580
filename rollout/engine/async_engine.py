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

Past 400 lines: each `RolloutEngine` method it runs is written out here (signature, defaults and
docstring an IDE shows), each one call into the engine's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.api import DEFAULT_BUCKET_BYTES, DEFAULT_COMPONENT
from rollout.engine.rollout_engine import RolloutEngine
from rollout.engine.weight_sync import StagedPush
from rollout.errors import EngineDeadError, RequestFailedError
from rollout.outputs import RolloutOutput

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig

    from rollout.sampling_params import SamplingParams

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

    async def add_requests(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        images: Sequence | None = None,
    ) -> OutputStream:
        """`RolloutEngine.add_requests`, returning the stream of the outputs of what it queues."""
        return await self._open_stream(lambda: self.engine.add_requests(prompts, params, images=images))

    async def add_request(
        self,
        prompt: str,
        params: SamplingParams,
        *,
        images: Sequence | None = None,
        prompt_index: int = 0,
        request_id: str | None = None,
        base_seed: int | None = None,
    ) -> OutputStream:
        """`RolloutEngine.add_request`, returning the stream of the outputs of what it queues."""
        return await self._open_stream(
            lambda: self.engine.add_request(
                prompt, params, images=images, prompt_index=prompt_index, request_id=request_id, base_seed=base_seed
            )
        )

    async def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        images: Sequence | None = None,
    ) -> list[RolloutOutput]:
        """`RolloutEngine.generate`, sharing batches with every other caller's requests; outputs
        ordered by prompt, then sample (aborted ones have status "aborted")."""
        async with await self.add_requests(prompts, params, images=images) as stream:
            outputs = {output.request_id: output async for output in stream}
        return [outputs[request_id] for request_id in stream.request_ids]

    async def generate_stream(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        images: Sequence | None = None,
    ) -> AsyncIterator[RolloutOutput]:
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
        """Whether `pause` holds the engine (until `resume`)."""
        return self._paused

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine cannot serve, or None; read at once, not between two steps."""
        if self.engine.dead is not None:
            return self.engine.dead
        if self._failure is not None:
            return EngineDeadError(f"the engine's thread failed: {self._failure}")
        return None

    # The hot-swap API and worker functions, each `RolloutEngine`'s method of the same name and
    # signature, run in the engine's thread between two steps.

    async def update_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        check_finite: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        delta: bool = False,
    ) -> int:
        """`RolloutEngine.update_weights` between two steps: replace weights of `component` on
        every worker, all or nothing; returns the new weight version."""
        return await self._call(
            self.engine.update_weights,
            named_tensors,
            component=component,
            version=version,
            mode=mode,
            check_finite=check_finite,
            bucket_bytes=bucket_bytes,
            delta=delta,
        )

    async def update_weights_from_disk(
        self,
        path: str | Path,
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        check_finite: bool = True,
    ) -> int:
        """`RolloutEngine.update_weights_from_disk` between two steps: `update_weights` from a
        .safetensors file or a component folder every worker reads itself."""
        return await self._call(
            self.engine.update_weights_from_disk,
            path,
            component=component,
            version=version,
            mode=mode,
            check_finite=check_finite,
        )

    async def update_weights_from_worker(
        self,
        method: str,
        args: Sequence = (),
        kwargs: dict | None = None,
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        check_finite: bool = True,
    ) -> int:
        """`RolloutEngine.update_weights_from_worker` between two steps: `update_weights` with
        tensors the `@stages_weights` worker function `method` returns or yields on every rank."""
        return await self._call(
            self.engine.update_weights_from_worker,
            method,
            args,
            kwargs,
            component=component,
            version=version,
            mode=mode,
            check_finite=check_finite,
        )

    async def open_weight_push(
        self,
        *,
        component: str = DEFAULT_COMPONENT,
        check_finite: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        version: int | None = None,
        delta: bool = False,
    ) -> StagedPush:
        """`RolloutEngine.open_weight_push` between two steps: `update_weights` in parts (see
        `add_to_weight_push`, `finish_weight_push`, `abort_weight_push`)."""
        return await self._call(
            self.engine.open_weight_push,
            component=component,
            check_finite=check_finite,
            bucket_bytes=bucket_bytes,
            version=version,
            delta=delta,
        )

    async def finish_weight_push(self, push: StagedPush, *, version: int | None = None, mode: str = "wait") -> int:
        """`RolloutEngine.finish_weight_push` between two steps: apply a push from
        `open_weight_push`; returns the new weight version."""
        return await self._call(self.engine.finish_weight_push, push, version=version, mode=mode)

    async def abort_weight_push(self, push: StagedPush, cause: BaseException) -> None:
        """`RolloutEngine.abort_weight_push` between two steps: drop what a push staged."""
        return await self._call(self.engine.abort_weight_push, push, cause)

    async def add_to_weight_push(self, push: StagedPush, named_tensors) -> None:
        """`push.add(named_tensors)` (a push from `open_weight_push`), between two steps: the
        engine steps on between the parts of a push that arrives over time."""
        await self._call(push.add, named_tensors)

    async def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> list[int]:
        """`RolloutEngine.init_weight_update_group` between two steps: join a trainer's broadcast
        group; returns the workers' group ranks."""
        return await self._call(
            self.engine.init_weight_update_group,
            master_address,
            master_port,
            rank_offset,
            world_size,
            backend,
            timeout_s,
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[tuple[int, ...]],
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        check_finite: bool = True,
    ) -> int:
        """`RolloutEngine.update_weights_from_distributed` between two steps: `update_weights`
        with tensors the trainer broadcasts through the group."""
        return await self._call(
            self.engine.update_weights_from_distributed,
            names,
            dtypes,
            shapes,
            component=component,
            version=version,
            mode=mode,
            bucket_bytes=bucket_bytes,
            check_finite=check_finite,
        )

    async def check_weight_update(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[tuple[int, ...]],
        component: str = DEFAULT_COMPONENT,
    ) -> None:
        """`RolloutEngine.check_weight_update` between two steps: raise ValueError if an update
        with these tensors would be refused."""
        return await self._call(self.engine.check_weight_update, names, dtypes, shapes, component)

    async def weights_checksum(self, component: str = DEFAULT_COMPONENT) -> str:
        """`RolloutEngine.weights_checksum` between two steps: SHA-256 of every weight of
        `component`; raises if the ranks disagree."""
        return await self._call(self.engine.weights_checksum, component)

    async def load_lora(
        self,
        name: str,
        source: str | Path | Mapping[str, torch.Tensor],
        config: LoraConfig | Mapping | None = None,
        *,
        version: int | None = None,
        check_finite: bool = True,
    ) -> int:
        """`RolloutEngine.load_lora` between two steps: load adapter `name` on every worker (or
        hot-swap it); returns the new weight version."""
        return await self._call(
            self.engine.load_lora, name, source, config, version=version, check_finite=check_finite
        )

    async def unload_lora(self, name: str) -> None:
        """`RolloutEngine.unload_lora` between two steps: remove adapter `name` from every worker."""
        return await self._call(self.engine.unload_lora, name)

    async def sleep(self, level: int = 1) -> None:
        """`RolloutEngine.sleep` between two steps: free the workers' weight memory (1: offload,
        2: discard)."""
        return await self._call(self.engine.sleep, level)

    async def wake_up(self) -> None:
        """`RolloutEngine.wake_up` between two steps: restore the weights after `sleep`."""
        return await self._call(self.engine.wake_up)

    async def collective_rpc(
        self,
        method: str | Callable,
        args: Sequence = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """`RolloutEngine.collective_rpc` between two steps: a worker method on every rank or on
        `ranks`; one result per rank, in rank order."""
        return await self._call(self.engine.collective_rpc, method, args, kwargs, timeout, ranks)

    async def check_health(self) -> None:
        """`RolloutEngine.check_health` between two steps: raise if a worker cannot serve."""
        return await self._call(self.engine.check_health)

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
