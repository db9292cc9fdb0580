"""`RemoteRolloutEngine`: a rollout service (`python -m rollout.serve`) behind `RolloutEngine`'s API.

A trainer swaps `RolloutEngine(config)` for `RemoteRolloutEngine(url, api_key=...)` and changes
nothing else: the methods take the same arguments and return the same types, and the same seeds
give bitwise the same outputs, trajectories included. Tensors cross as safetensors (`rollout.http.wire`).

`add_request` opens one streamed request per prompt; `step()` returns the outputs that arrived
since the last call, waiting for at least one while any request is unfinished. Errors come back as
the exception the engine raised (ValueError for a bad request, EngineDeadError when a worker is gone);
a server that is gone is an EngineDeadError too, and a call past `timeout_s` a TimeoutError.

Every answer names the server instance that gave it (`rollout.serve.instance`): once another one
answers (the server restarted, its weights and adapters gone), every call raises EngineDeadError
naming the restart, until `reconnect()` accepts the new server.

Past 400 lines: every call of the API is written out here (signature, defaults and docstring an IDE
shows), each one POST of its route's body (`rollout.serve.routes`) beside the HTTP plumbing it shares.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
from peft import LoraConfig
from tqdm.auto import tqdm

from rollout.api import DEFAULT_BUCKET_BYTES, DEFAULT_COMPONENT, ranks_list
from rollout.config import EngineConfig
from rollout.errors import EngineDeadError, RequestIdTaken
from rollout.http.wire import (
    FRAMES_MEDIA_TYPE,
    SAFETENSORS_MEDIA_TYPE,
    FrameReader,
    OutputDecoder,
    WireError,
    images_to_tensors,
    tensors_to_bytes,
)
from rollout.input_images import images_per_prompt
from rollout.model_spec import ModelSpec
from rollout.outputs import RolloutOutput
from rollout.sampling_params import SamplingParams
from rollout.serve import API_KEY_ENV
from rollout.serve.error_table import exception_for, worker_error
from rollout.serve.instance import InstanceCheck
from rollout.serve.routes import ROUTES, body_json, path
from rollout.serve.socket_post import AnswerTimedOut, ConnectionFailed, SocketTarget, post_chunked
from rollout.serve.weight_stream import weight_frames

WEIGHT_PUSHES = ("socket", "httpx")  # RemoteRolloutEngine(weight_push=...)
CONNECT_TIMEOUT_S = 10.0


class RemoteRolloutEngine:
    """`RolloutEngine`'s API over HTTP. `config` and `model_spec` are the server's.

    url: "http://host:port" of a rollout service; api_key: its key (None reads $ROLLOUT_API_KEY, as
    the server and the recipes do; a server started with --no-auth needs none, and a client without
    a key asks the server's /health whether it needs one, raising PermissionError before anything
    else is sent if it does);
    timeout_s: how long one call may wait for its answer (None: as long as the server works on it;
    a closed connection still fails at once); instance_id: the server instance to talk to (None:
    the one that answers first; see `instance_id`); weight_push: how `update_weights` sends its
    body: "socket" (the default) writes it from the tensors' memory to a socket of its own
    (`rollout.serve.socket_post`), falling back to httpx where that cannot go (https, a proxy);
    "httpx" always sends it with httpx, as every other call is.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout_s: float | None = None,
        instance_id: str | None = None,
        weight_push: str = "socket",
    ):
        if weight_push not in WEIGHT_PUSHES:
            raise ValueError(f"weight_push must be one of {WEIGHT_PUSHES}, got {weight_push!r}")
        self.url = url.rstrip("/")
        self._instance = InstanceCheck(self.url, instance_id)
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="remote-rollout-engine", daemon=True)
        self._thread.start()
        timeout = httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S)
        self._headers, self._timeout_s = headers, timeout_s
        self._push_target = SocketTarget.of(self.url) if weight_push == "socket" else None
        # Idle connections are dropped well before the server's keep-alive timeout (60 s) closes
        # them: reusing one the server is closing fails the call.
        limits = httpx.Limits(keepalive_expiry=10.0)
        hooks = {"request": [self._address_request], "response": [self._check_answer]}
        self._client = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout, limits=limits, event_hooks=hooks
        )
        self._closed = False
        # Outputs of add_request() streams that step() has not returned yet, and who is still running.
        self._ready: collections.deque = collections.deque()
        self._unfinished: set[str] = set()
        self._changed = threading.Condition()
        try:
            if not api_key:
                self._refuse_a_keyed_server()
            info = self.server_info()
        except BaseException:
            self.shutdown()  # no thread left behind by a server that is down or refuses the key
            raise
        self._take_server_info(info)

    # Generation.

    def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        images: Sequence | None = None,
        use_tqdm: bool = False,
    ) -> list[RolloutOutput]:
        """`RolloutEngine.generate`: outputs ordered by prompt, then sample. `images` travel as
        uint8 tensors in a safetensors body."""
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"generate() drives the engine itself, but {len(self._unfinished)} requests added with "
                "add_request() are unfinished; step() them to completion or abort() them first"
            )
        body = body_json("generate", prompts=prompts, params=_params_json(params), stream=True)
        body = _with_images(body, images, 1 if isinstance(prompts, str) else len(prompts))
        with tqdm(desc="rollout", unit="sample", disable=not use_tqdm) as bar:

            async def collect() -> list[RolloutOutput]:
                ids, outputs = await self._open_stream(body)
                bar.total = len(ids)
                found = {}
                async for output in outputs:
                    found[output.request_id] = output
                    bar.update(1)
                return [found[request_id] for request_id in ids]

            return self._run(collect())

    def add_request(
        self,
        prompt: str,
        params: SamplingParams,
        *,
        images: Sequence | None = None,
        prompt_index: int = 0,
        request_id: str | None = None,
        base_seed: int | None = None,
    ) -> list[str]:
        """`RolloutEngine.add_request`: queue one prompt's samples; returns their ids. Their outputs
        come from `step()`."""
        body = body_json(
            "generate",
            prompts=prompt,
            params=_params_json(params),
            stream=True,
            request_id=request_id,
            prompt_index=prompt_index,
            base_seed=base_seed,
        )
        body = _with_images(body, None if images is None else [images], 1)

        async def start() -> list[str]:
            try:
                ids, outputs = await self._open_stream(body)
            except RequestIdTaken as error:
                raise self._whose_id(request_id, error) from None
            with self._changed:
                self._unfinished.update(ids)
            self._loop.create_task(self._collect_into_ready(ids, outputs))
            return ids

        return self._run(start())

    def _whose_id(self, request_id: str, error: RequestIdTaken) -> RequestIdTaken:
        """The server's refusal of `request_id`, saying whose request holds it: the server cannot
        tell its clients apart, but this client knows its own unfinished requests."""
        with self._changed:
            own = [i for i in self._unfinished if i == request_id or i.startswith(f"{request_id}-")]
        whose = (
            f"this client's own unfinished requests {sorted(own)[:3]} hold it"
            if own
            else f"no unfinished request of this client holds it: another client of the server at {self.url} does"
        )
        return RequestIdTaken(f"{error} ({whose})")

    def step(self) -> list[RolloutOutput]:
        """The outputs of `add_request` calls that arrived since the last call; waits for at least
        one while any request is unfinished, and returns [] when none is. A stream's error is
        raised once the outputs that arrived before it have been returned."""
        with self._changed:
            self._changed.wait_for(lambda: self._ready or not self._unfinished)
            outputs = [item for item in self._ready if not isinstance(item, BaseException)]
            errors = [item for item in self._ready if isinstance(item, BaseException)]
            # Outputs first: an error waits for the next call, so none that arrived with it is lost.
            self._ready = collections.deque(errors if outputs else errors[1:])
        if errors and not outputs:
            raise errors[0]
        return outputs

    def abort(self, request_ids: str | Iterable[str]) -> list[RolloutOutput]:
        """`RolloutEngine.abort`: by sample or group id; returns once the server's workers have freed
        their state. The aborted outputs are returned here, never by `step()`."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = self._run(self._post_outputs(path("abort"), body_json("abort", request_ids=list(request_ids))))
        ids = {output.request_id for output in aborted}
        with self._changed:
            self._unfinished -= ids
            # The stream may have delivered them already: step() must not return them too.
            self._ready = collections.deque(
                item for item in self._ready if isinstance(item, BaseException) or item.request_id not in ids
            )
            self._changed.notify_all()
        return aborted

    def has_unfinished_requests(self) -> bool:
        """Whether an `add_request` output has not been returned by `step()` yet."""
        with self._changed:
            return bool(self._unfinished or self._ready)

    def pause(self, mode: str = "abort") -> None:
        """Stop the server's engine: "abort", "wait" or "keep" (see `AsyncRolloutEngine.pause`)."""
        self._call("pause", mode=mode)

    def resume(self) -> None:
        """Let the server's engine step again after `pause`."""
        self._call("resume")

    # Worker functions.

    def collective_rpc(
        self,
        method: str | Callable,
        args: Sequence = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """A worker method on every rank or on `ranks`; one result per rank, in rank order. By
        name (a callable cannot cross HTTP: a TypeError before anything is sent), with JSON
        arguments and results."""
        if not isinstance(method, str):
            raise TypeError(
                "a callable cannot be sent over HTTP; make it a method of the server's --worker-extension-cls "
                "and call it by name"
            )
        return self._call(
            "collective_rpc", method=method, args=list(args), kwargs=kwargs, timeout=timeout, ranks=ranks_list(ranks)
        )

    def check_health(self) -> None:
        """Raise if the server cannot serve (EngineDeadError when it is gone or restarted)."""
        self._request("GET", path("health"))

    def server_info(self) -> dict:
        """The server's engine config, model spec, weight version, adapters, sleep level and load."""
        return self._request("GET", path("server_info"))

    # The hot-swap API.

    @property
    def weight_version(self) -> int:
        """The server engine's weight version now (asks the server)."""
        return self.server_info()["weight_version"]

    @property
    def sleep_level(self) -> int:
        """The server engine's sleep level now (asks the server)."""
        return self.server_info()["sleep_level"]

    def update_weights(
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
        """`RolloutEngine.update_weights`: the tensors stream to the server in buckets of about
        `bucket_bytes`, read from `named_tensors` as they are sent (`rollout.serve.weight_stream`),
        and the server stages each bucket as it arrives. A component the model lacks is refused
        before anything is sent."""
        self.model_spec.check_component(component)
        options = body_json(
            "update_weights",
            component=component,
            version=version,
            mode=mode,
            check_finite=check_finite,
            bucket_bytes=bucket_bytes,
            delta=delta,
        )
        body, headers = weight_frames(named_tensors, options, bucket_bytes), {"content-type": FRAMES_MEDIA_TYPE}
        if self._push_target is None:
            answer = self._request_route("update_weights", content=_async_pieces(body), headers=headers)
        else:
            answer = self._post_over_socket("update_weights", body, headers)
        return answer[ROUTES["update_weights"].answer]

    def update_weights_from_disk(
        self,
        path: str | Path,
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        check_finite: bool = True,
    ) -> int:
        """`update_weights` from a .safetensors file or a component folder the workers read.
        `path` is on the server's machine. A component the model lacks is refused before anything
        is sent."""
        self.model_spec.check_component(component)
        return self._call(
            "update_weights_from_disk",
            model_path=str(path),
            component=component,
            version=version,
            mode=mode,
            check_finite=check_finite,
        )

    def update_weights_from_worker(
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
        """`update_weights` with tensors every worker reads itself: the `@stages_weights` worker
        function `method` returns or yields them (`rollout.worker.marks`). `method` is a function
        of the server's --worker-extension-cls; its arguments are JSON. A component the model
        lacks is refused before anything is sent."""
        self.model_spec.check_component(component)
        return self._call(
            "update_weights_from_worker",
            method=method,
            args=args,
            kwargs=kwargs,
            component=component,
            version=version,
            mode=mode,
            check_finite=check_finite,
        )

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> list[int]:
        """Join a trainer's broadcast group; returns the workers' group ranks."""
        return self._call(
            "init_weight_update_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            backend=backend,
            timeout_s=timeout_s,
        )

    def update_weights_from_distributed(
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
        """`update_weights` with tensors the trainer broadcasts through the group."""
        return self._call(
            "update_weights_from_distributed",
            **_tensor_layout(names, dtypes, shapes),
            component=component,
            version=version,
            mode=mode,
            bucket_bytes=bucket_bytes,
            check_finite=check_finite,
        )

    def check_weight_update(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[tuple[int, ...]],
        component: str = DEFAULT_COMPONENT,
    ) -> None:
        """Raise ValueError if an update with these tensors would be refused."""
        return self._call("check_weight_update", **_tensor_layout(names, dtypes, shapes), component=component)

    def weights_checksum(self, component: str = DEFAULT_COMPONENT) -> str:
        """SHA-256 of every weight of `component`; raises if the ranks disagree. A component the
        model lacks is refused before anything is sent."""
        self.model_spec.check_component(component)
        return self._call("weights_checksum", component=component)

    def load_lora(
        self,
        name: str,
        source: str | Path | Mapping[str, torch.Tensor],
        config: LoraConfig | Mapping | None = None,
        *,
        version: int | None = None,
        check_finite: bool = True,
    ) -> int:
        """`RolloutEngine.load_lora`: a folder on the server's machine, or tensors with their config
        (sent as a safetensors body)."""
        if isinstance(source, str | Path):
            return self._call(
                "load_lora", lora_name=name, lora_path=str(source), version=version, check_finite=check_finite
            )
        if not isinstance(source, Mapping):
            raise TypeError(f"LoRA source must be a folder path or a mapping of tensors, got {type(source).__name__}")
        if config is None:
            raise ValueError(f"LoRA {name!r} from tensors needs a config (a peft.LoraConfig or its dict)")
        options = body_json(
            "load_lora_tensors",
            lora_name=name,
            lora_config=_lora_config_json(config),
            version=version,
            check_finite=check_finite,
        )
        return self._post_tensors("load_lora_tensors", dict(source), options)

    def unload_lora(self, name: str) -> None:
        """Remove adapter `name` from the server's workers."""
        return self._call("unload_lora", lora_name=name)

    def lora_modules(self, name: str) -> int:
        """How many modules adapter `name` binds on the server."""
        loras = self.server_info()["loras"]
        if name not in loras:
            raise ValueError(f"no LoRA named {name!r} is loaded; loaded: {sorted(loras)}")
        return loras[name]

    def list_loras(self) -> list[str]:
        """Names of the adapters loaded on the server, sorted."""
        return sorted(self.server_info()["loras"])

    def sleep(self, level: int = 1) -> None:
        """Free the workers' weight memory (1: offload, 2: discard)."""
        return self._call("sleep", level=level)

    def wake_up(self) -> None:
        """Restore the workers' weights after `sleep`."""
        return self._call("wake_up")

    # Lifetime.

    @property
    def instance_id(self) -> str:
        """The id of the server instance this client talks to (random, and its start time): every
        answer carries it, and one from another instance (a restarted server) fails the call and
        every later one with EngineDeadError, until `reconnect()`."""
        return self._instance.instance_id

    def reconnect(self) -> str:
        """Accept the server that answers at `url` now (after an EngineDeadError naming a restart),
        as a new client would: its config, weights and adapters are what it has now (push yours
        again), and requests of the old instance are forgotten. Returns the new instance id."""
        previous, self._instance = self._instance, InstanceCheck(self.url)  # takes the next answer's id
        try:
            info = self.server_info()
        except BaseException:
            self._instance = previous  # as it was (still failed, if it was)
            raise
        self._take_server_info(info)
        if self._instance.instance_id != previous.instance_id:
            with self._changed:  # their streams ended with the old server
                self._unfinished.clear()
                self._ready.clear()
                self._changed.notify_all()
        return self._instance.instance_id

    def shutdown(self) -> None:
        """Close the connection (the server keeps running)."""
        if not self._closed:
            self._run(self._client.aclose())
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> RemoteRolloutEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # HTTP.

    def _refuse_a_keyed_server(self) -> None:
        """For a client without a key: ask `/health` (which needs none) whether the server requires
        one, and raise PermissionError naming where the key goes if it does, before any call of the
        API is sent."""
        if self._request("GET", path("health"))["api_key_required"]:
            raise PermissionError(
                f"the rollout server at {self.url} requires an API key, and this client has none: export "
                f"{API_KEY_ENV}=<key>, or pass RemoteRolloutEngine(url, api_key=<key>). A server started without "
                "one generated its key into its --api-key-file (its log names the file)"
            )

    def _take_server_info(self, info: dict) -> None:
        self.config = EngineConfig.described(info["engine_config"])
        self.model_spec = ModelSpec(**info["model_spec"])

    async def _address_request(self, request: httpx.Request) -> None:
        request.headers.update(self._instance.request_headers())

    async def _check_answer(self, response: httpx.Response) -> None:
        what = f"{response.request.method} {response.request.url.path}"
        self._instance.check(response.status_code, response.headers, what)

    def _run(self, coroutine: Coroutine) -> Any:
        if self._closed:
            coroutine.close()
            raise RuntimeError("this RemoteRolloutEngine is shut down; create a new one")
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()
        except httpx.TransportError as error:
            raise self._transport_failure(error) from error

    def _transport_failure(self, error: httpx.TransportError | ConnectionFailed) -> Exception:
        """The engine's exception for a call that got no answer: a timeout, or a server gone."""
        if isinstance(error, httpx.TimeoutException | AnswerTimedOut):
            return TimeoutError(f"the rollout server at {self.url} did not answer within timeout_s: {error!r}")
        return EngineDeadError(
            f"lost the rollout server at {self.url} ({type(error).__name__}: {error}); is it running? "
            "Requests it was running are gone"
        )

    def _request(self, method: str, path: str, **kwargs) -> dict:
        async def call() -> dict:
            return _checked(await self._client.request(method, path, **kwargs)).json()

        return self._run(call())

    def _call(self, route: str, **fields) -> Any:
        """POST route `route` with a body of `fields` (its model's defaults for the rest); returns
        the answer's field the route names (None if it names none)."""
        answer = self._request_route(route, json=body_json(route, **fields) if ROUTES[route].body else {})
        return answer[ROUTES[route].answer] if ROUTES[route].answer else None

    def _post_tensors(self, route: str, tensors: dict[str, torch.Tensor], options: dict) -> Any:
        """POST route `route` with a safetensors body of `tensors`, `options` in its metadata."""
        content = tensors_to_bytes(tensors, {"request": json.dumps(options)})
        answer = self._request_route(route, content=content, headers={"content-type": SAFETENSORS_MEDIA_TYPE})
        return answer[ROUTES[route].answer]

    def _request_route(self, route: str, **kwargs) -> dict:
        return self._request(ROUTES[route].method, ROUTES[route].path, **kwargs)

    def _post_over_socket(self, route: str, body: Iterator[bytes | memoryview], headers: dict[str, str]) -> dict:
        """POST route `route` with a chunked `body` on a connection of its own (`post_chunked`),
        from the calling thread; answers and failures as `_request_route`'s."""
        if self._closed:
            raise RuntimeError("this RemoteRolloutEngine is shut down; create a new one")
        method, route_path = ROUTES[route].method, ROUTES[route].path
        headers = {**self._headers, **self._instance.request_headers(), **headers}
        try:
            answer = post_chunked(
                self._push_target,
                route_path,
                headers,
                body,
                timeout_s=self._timeout_s,
                connect_timeout_s=CONNECT_TIMEOUT_S,
            )
        except ConnectionFailed as error:
            raise self._transport_failure(error) from error
        self._instance.check(answer.status, answer.headers, f"{method} {route_path}")
        return _answer_json(answer.status, answer.content)

    async def _post_outputs(self, path: str, body: dict) -> list[RolloutOutput]:
        response = _checked(await self._client.post(path, json=body))
        decoder, outputs = OutputDecoder(), []
        reader = FrameReader()
        for fields, tensors in reader.feed(response.content):
            if fields["kind"] != "requests":
                output = decoder.decode(fields, tensors)
                if output is not None:
                    outputs.append(output)
        reader.close()
        return outputs

    async def _open_stream(self, body: dict | bytes):
        """Start a streamed generate (a JSON body, or a safetensors one with input images); returns
        its sample ids and an async iterator of its outputs."""
        if isinstance(body, bytes):
            headers = {"content-type": SAFETENSORS_MEDIA_TYPE}
            request = self._client.build_request("POST", path("generate"), content=body, headers=headers)
        else:
            request = self._client.build_request("POST", path("generate"), json=body)
        response = await self._client.send(request, stream=True)
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            _checked(response)
        frames = _frames(response)
        fields, _ = await anext(frames)
        if fields["kind"] == "error":
            raise exception_for(fields["type"], fields["message"], 500)
        return fields["request_ids"], _outputs(frames)

    async def _collect_into_ready(self, ids: list[str], outputs) -> None:
        try:
            async for output in outputs:
                with self._changed:
                    if output.request_id in self._unfinished:  # not when abort() returned it already
                        self._unfinished.discard(output.request_id)
                        self._ready.append(output)
                        self._changed.notify_all()
            with self._changed:
                missing = self._unfinished.intersection(ids)
            if missing:
                raise WireError(f"the server's stream ended without outputs for {sorted(missing)}")
        except Exception as error:  # the stream failed: step() raises it, and its requests are gone
            if isinstance(error, httpx.TransportError):  # the engine's exception, as _run raises it
                cause, error = error, self._transport_failure(error)
                error.__cause__ = cause
            with self._changed:
                self._unfinished.difference_update(ids)
                self._ready.append(error)
                self._changed.notify_all()


async def _async_pieces(pieces: Iterator[bytes | memoryview]) -> AsyncIterator[bytes | memoryview]:
    """A body httpx's AsyncClient sends as it is produced (chunked), from a plain iterator."""
    for piece in pieces:
        yield piece


async def _frames(response: httpx.Response):
    reader = FrameReader()
    try:
        async for chunk in response.aiter_bytes():
            for item in reader.feed(chunk):
                yield item
        reader.close()
    finally:
        await response.aclose()


async def _outputs(frames):
    decoder = OutputDecoder()
    async for fields, tensors in frames:
        if fields["kind"] == "error":
            raise exception_for(fields["type"], fields["message"], 500)
        output = decoder.decode(fields, tensors)
        if output is not None:
            yield output


def _checked(response: httpx.Response) -> httpx.Response:
    if response.status_code < 400:
        return response
    raise _error_answer(response.status_code, response.content, response.text)


def _answer_json(status: int, content: bytes) -> dict:
    """The JSON of an answer that came without httpx, or the exception an error answer stands for."""
    if status >= 400:
        raise _error_answer(status, content, content.decode("utf-8", errors="replace"))
    return json.loads(content)


def _error_answer(status: int, content: bytes, text: str) -> Exception:
    """The exception for an error answer: the one its {"error": {"type", "message"}} body names,
    else the one of its status, with its text."""
    try:
        error = json.loads(content)["error"]
        error_type, message = error["type"], error["message"]
    except (ValueError, KeyError, TypeError):
        error_type, message, error = "", text, {}
    if "worker" in error:  # a worker function raised: the engine's own error, rank and traceback
        return worker_error(error["worker"])
    return exception_for(error_type, message, status)


def _with_images(body: dict, images, num_prompts: int) -> dict | bytes:
    """`body` as it goes out: JSON without images, a safetensors body (rollout.http.wire) with them."""
    if images is None:
        return body
    tensors = images_to_tensors(images_per_prompt(images, num_prompts))
    return tensors_to_bytes(tensors, {"request": json.dumps(body)})


def _params_json(params: SamplingParams | Sequence[SamplingParams] | None):
    if params is None:
        return None
    if isinstance(params, SamplingParams):
        return _one_params_json(params)
    return [_one_params_json(p) for p in params]


def _one_params_json(params: SamplingParams) -> dict:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    return dataclasses.asdict(params)


def _tensor_layout(names, dtypes, shapes) -> dict:
    return {
        "names": list(names),
        "dtypes": [str(dtype).removeprefix("torch.") for dtype in dtypes],
        "shapes": [list(shape) for shape in shapes],
    }


def _lora_config_json(config: LoraConfig | Mapping) -> dict:
    data = config.to_dict() if isinstance(config, LoraConfig) else dict(config)
    return {key: sorted(value) if isinstance(value, set) else value for key, value in data.items()}
