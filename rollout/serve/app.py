"""The rollout service's routes: each parses one body, calls the async engine, and returns its answer.

Paths come from the route table (`routes.ROUTES`) and status codes from the error table
(`error_table.STATUS_OF`), which the client reads too. An error's body holds the engine's own
message: {"error": {"type": "ValueError", "message": "invalid request: ..."}}. Bad input is a 4xx and
the server stays up; a dead engine answers 503 everywhere, `/health` included. Every answer carries
the server's instance id (`instance.InstanceHeaders`), made when the app is built.
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations, and those
# name dependencies made inside `build_app`, which only eager evaluation can see.
import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

import torch
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.engine.async_engine import AsyncRolloutEngine, OutputStream
from rollout.errors import WorkerError
from rollout.http.guard import RequestGuard, require_api_key
from rollout.http.hosts import LOOPBACK_NAMES
from rollout.http.wire import (
    FRAMES_MEDIA_TYPE,
    SAFETENSORS_MEDIA_TYPE,
    OutputEncoder,
    error_frame,
    frame,
    image_sizes,
    named_images,
)
from rollout.lora.manager import count_non_lora_keys, infer_config, read_lora_folder, remote_config_problems
from rollout.sampling_params import SamplingParams
from rollout.serve import protocol
from rollout.serve.admission import Admission, Share
from rollout.serve.error_table import STATUS_OF, worker_error_fields
from rollout.serve.instance import InstanceHeaders, new_instance_id
from rollout.serve.push_turns import PushTurns
from rollout.serve.request_bodies import RequestBodies, describe
from rollout.serve.routes import path
from rollout.serve.weight_stream import receive_update
from rollout.worker.marks import READ_ONLY, STAGES_WEIGHTS, engine_routes, functions_marked, mark_of, worker_functions
from rollout.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    """api_key: required as `Authorization: Bearer <key>` on every route but /health (None: open;
    the command line makes that an explicit --no-auth). allowed_hosts: the names a request's Host
    header may carry (None: any; see `rollout.http.hosts.allowed_hosts`). max_body_bytes: of a JSON body;
    max_upload_bytes: of a safetensors body (weights, adapters); max_samples_per_request: outputs
    of one generate call (prompts x num_samples x a tree's leaves per sample). rpc_allow: worker
    functions not marked read-only that /collective_rpc may call too (see `_rpc_refusal`).
    input_image_budget_bytes: see `rollout.serve.admission.ImageBudget`."""

    api_key: str | None = None
    allowed_hosts: frozenset[str] | None = LOOPBACK_NAMES
    rpc_allow: frozenset[str] = frozenset()
    body_timeout_s: float = 30.0  # the longest pause between two chunks of a request body (408 past it)
    upload_timeout_s: float = 600.0  # the longest a body of tensors may take to arrive whole (408 past it)
    max_body_bytes: int = 1 << 20
    max_upload_bytes: int = 8 << 30
    max_samples_per_request: int = 1024
    input_image_budget_bytes: int = 1 << 30  # decoded input images of all requests together (`admission`)


def build_app(engine: AsyncRolloutEngine, settings: ServerSettings) -> FastAPI:
    # The schema and its pages are served below, behind the key like every route but /health.
    app = FastAPI(
        title="diffusion-rollout",
        summary="RL rollouts of diffusion policies, with hot-swappable weights",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(RequestGuard, hosts=settings.allowed_hosts)
    # Added last, so outermost: the guard's refusals carry the instance too.
    instance_id = new_instance_id()
    app.add_middleware(InstanceHeaders, instance_id=instance_id, weight_version=lambda: engine.engine.weight_version)
    for error_class, status in STATUS_OF:
        app.add_exception_handler(error_class, _error_handler(status))
    app.add_exception_handler(WorkerError, _worker_error)
    # Starlette's own (404 for an unknown path, 405 for a wrong method) included: one error format.
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

    key_required = settings.api_key is not None  # told to anyone: a client without a key refuses to start

    live_check: asyncio.Future | None = None  # the engine's check in flight; polls share it

    @app.get(path("health"))
    async def health() -> dict:
        """200 while every worker answers; 503 with the reason once one is gone. The check runs
        between engine steps; while the engine is in a long call (a hot swap waiting for running
        requests) the answer comes from what is known at once, within _HEALTH_WAIT_S: "busy".
        One check at a time: polls during a long step share it, rather than queue one each for
        the engine to run between its next steps. `api_key_required`: whether every other route
        needs `Authorization: Bearer <key>`."""
        nonlocal live_check
        if live_check is None or live_check.done():
            live_check = asyncio.ensure_future(engine.check_health())
            live_check.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, not logged
        try:
            await asyncio.wait_for(asyncio.shield(live_check), _HEALTH_WAIT_S)
        except TimeoutError:
            if engine.dead is not None:
                raise engine.dead from None
            return {"status": "busy", "instance_id": instance_id, "api_key_required": key_required}
        return {"status": "ok", "instance_id": instance_id, "api_key_required": key_required}

    router = APIRouter(dependencies=[Depends(require_api_key(settings.api_key))])
    # Weight updates one at a time: the engine refuses one while a streamed push stages, so the
    # next waits for its turn rather than being refused.
    push_turns = PushTurns(settings.body_timeout_s)
    admission = Admission(settings.input_image_budget_bytes)
    # Answers are encoded off the event loop: a burst of outputs (64 clients' groups finishing in
    # one step) took the loop a millisecond each, and /health waited behind them.
    answers = ThreadPoolExecutor(_ANSWER_THREADS, thread_name_prefix="rollout-answer")

    async def frames_of(request_ids: list[str], outputs) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(answers, _frames, request_ids, outputs)

    bodies = RequestBodies(settings, admission)
    json_body = bodies.json_dependency

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict:
        return app.openapi()

    @router.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="diffusion-rollout")

    @router.get(path("server_info"))
    async def server_info() -> dict:
        config = dataclasses.asdict(engine.engine.config)
        config["executor"] = _name_of(config["executor"])
        config["worker_extension_cls"] = _name_of(config["worker_extension_cls"])
        return {
            "instance_id": instance_id,
            "engine_config": config,
            "model_spec": dataclasses.asdict(engine.engine.model_spec),
            **await engine.state(),
        }

    @router.post(path("generate"))
    async def generate(request: Request):
        """Body: the JSON of `GenerateBody`; or, with input images, a safetensors body whose
        metadata "request" holds that JSON (rollout.http.wire: images as uint8 tensors or PNG bytes)."""
        named = None
        if request.headers.get("content-type", "").startswith(SAFETENSORS_MEDIA_TYPE):
            limits = bodies.generate_limits(engine.engine.config.request_limits)
            tensors, body = await bodies.tensors(request, protocol.GenerateBody, *limits)
            named = named_images(tensors, 1 if isinstance(body.prompts, str) else len(body.prompts))
            del tensors
        else:
            body = await bodies.json(request, protocol.GenerateBody)
        prompts = [body.prompts] if isinstance(body.prompts, str) else body.prompts
        # Checking many params (each holds a step mask) is work: off the event loop, so /health answers.
        params = await admission.check(_sampling_params, body.params)
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        counts = [p.num_samples * p.leaves_per_sample for p in per_prompt]  # outputs: a tree's leaves count
        if sum(counts) > settings.max_samples_per_request:
            raise HTTPException(
                413,
                f"the request asks for {sum(counts)} samples; this server takes at most "
                f"{settings.max_samples_per_request} per request (--max-samples-per-request); split it",
            )
        if body.request_id is not None or body.prompt_index != 0 or body.base_seed is not None:
            if len(prompts) != 1 or isinstance(params, list):
                raise ValueError(
                    "request_id, prompt_index and base_seed make this add_request, for one prompt's group: "
                    "send exactly one prompt and one params"
                )
        share = images = None
        try:
            if named is not None:
                # The requests are checked with the images' sizes first (a PNG's from its header: a few
                # KB of PNG can decode to gigabytes, and a model that takes no images needs none
                # decoded), then the images take their share of the server's budget, then decode.
                sizes = await admission.check(image_sizes, named)
                await admission.check(engine.engine.check_requests, prompts, params, sizes)
                share = await admission.images.take(sum(3 * h * w for one in sizes for h, w in one))
                images = await admission.decode(named)
                del named
            if body.request_id is not None or body.prompt_index != 0 or body.base_seed is not None:
                stream = await engine.add_request(
                    prompts[0],
                    params,
                    images=None if images is None else images[0],
                    prompt_index=body.prompt_index,
                    request_id=body.request_id,
                    base_seed=body.base_seed,
                )
            else:
                stream = await engine.add_requests(prompts, params, images=images)
            del images  # the engine's requests hold them now, under the share, until they end
        except BaseException:
            if share is not None:
                share.give_back()
            raise
        if body.stream:
            return StreamingResponse(_stream_frames(stream, share, answers), media_type=FRAMES_MEDIA_TYPE)
        try:
            outputs = await _collect(stream, request)
        finally:
            if share is not None:
                share.give_back()
        return Response(await frames_of(stream.request_ids, outputs), media_type=FRAMES_MEDIA_TYPE)

    @router.post(path("abort"))
    async def abort_requests(body: Annotated[protocol.AbortBody, json_body(protocol.AbortBody)]):
        """Returns once the workers have freed the requests' state; the body holds their outputs."""
        aborted = await engine.abort(body.request_ids)
        return Response(await frames_of([o.request_id for o in aborted], aborted), media_type=FRAMES_MEDIA_TYPE)

    @router.post(path("pause"))
    async def pause(body: Annotated[protocol.PauseBody, json_body(protocol.PauseBody)]) -> dict:
        await engine.pause(body.mode)
        return {"paused": True, "mode": body.mode}

    @router.post(path("resume"))
    async def resume() -> dict:
        await engine.resume()
        return {"paused": False}

    @router.post(path("update_weights"))
    async def update_weights_from_tensor(request: Request) -> dict:
        """Body: a stream of bucket frames (`weight_stream`: the client's form, applied as it
        arrives); or one safetensors file of the tensors, its metadata "request" holding the options
        (JSON: small pushes, curl)."""
        if request.headers.get("content-type", "").startswith(FRAMES_MEDIA_TYPE):
            limits = settings.max_upload_bytes, settings.body_timeout_s, settings.upload_timeout_s
            return {"weight_version": await receive_update(request, engine, *limits, push_turns)}
        # Read whole before the lock: a body that trickles in holds no other push.
        tensors, options = await bodies.tensors(request, protocol.UpdateFromTensorBody)
        async with push_turns.turn():  # not beside a streamed push: the engine refuses updates while one stages
            version = await engine.update_weights(tensors, **options.model_dump())
        return {"weight_version": version}

    @router.post(path("update_weights_from_disk"))
    async def update_weights_from_disk(
        body: Annotated[protocol.UpdateFromDiskBody, json_body(protocol.UpdateFromDiskBody)],
    ):
        options = body.model_dump(exclude={"model_path"})
        async with push_turns.turn():
            return {"weight_version": await engine.update_weights_from_disk(body.model_path, **options)}

    @router.post(path("update_weights_from_worker"))
    async def update_weights_from_worker(
        body: Annotated[protocol.UpdateFromWorkerBody, json_body(protocol.UpdateFromWorkerBody)],
    ) -> dict:
        options = body.model_dump(exclude={"method", "args", "kwargs"})
        async with push_turns.turn():
            version = await engine.update_weights_from_worker(body.method, body.args, body.kwargs, **options)
        return {"weight_version": version}

    @router.post(path("weights_checksum"))
    async def get_weights_checksum(body: Annotated[protocol.ChecksumBody, json_body(protocol.ChecksumBody)]) -> dict:
        return {"checksum": await engine.weights_checksum(body.component)}

    @router.post(path("load_lora"))
    async def load_lora_adapter(request: Request) -> dict:
        """JSON {"lora_name", "lora_path"} for a folder on the server (read here, its files checked
        to be regular ones); or a safetensors body of the adapter's PEFT tensors with metadata
        "request": {"lora_name", "lora_config", "version"}. The config may build plain LoRA layers
        on the modules it lists, nothing else (`rollout.lora.manager.remote_config_problems`)."""
        if request.headers.get("content-type", "").startswith(SAFETENSORS_MEDIA_TYPE):
            tensors, body = await bodies.tensors(request, protocol.LoadLoraTensorsBody)
            config = body.lora_config
        else:
            body = await bodies.json(request, protocol.LoadLoraBody)
            tensors, config = await admission.read(read_lora_folder, body.lora_path, settings.max_upload_bytes)
            foreign = count_non_lora_keys(tensors)
            if foreign:  # the engine's refusal would name them: names from a file the client may not read
                raise ValueError(
                    f"LoRA {body.lora_name!r} refused: {foreign} of the {len(tensors)} tensors in {body.lora_path} "
                    "are not LoRA tensors ('<module>.lora_A.weight', '<module>.lora_B.weight'); their names are "
                    "not shown over HTTP, since the folder is read on the server: look at it there"
                )
            config = config if config is not None else infer_config(tensors)
        problems = remote_config_problems(config)
        if problems:
            raise ValueError(f"LoRA {body.lora_name!r} refused: " + "; ".join(problems))
        version = await engine.load_lora(
            body.lora_name, tensors, config, version=body.version, check_finite=body.check_finite
        )
        return {"weight_version": version, "loras": (await engine.state())["loras"]}

    @router.post(path("unload_lora"))
    async def unload_lora_adapter(
        body: Annotated[protocol.UnloadLoraBody, json_body(protocol.UnloadLoraBody)],
    ) -> dict:
        await engine.unload_lora(body.lora_name)
        return {"loras": (await engine.state())["loras"]}

    @router.post(path("sleep"))
    async def release_memory_occupation(
        body: Annotated[protocol.ReleaseMemoryBody, json_body(protocol.ReleaseMemoryBody)],
    ) -> dict:
        await engine.sleep(body.level)
        return {"sleep_level": (await engine.state())["sleep_level"]}

    @router.post(path("wake_up"))
    async def resume_memory_occupation() -> dict:
        await engine.wake_up()
        return {"sleep_level": 0}

    @router.post(path("init_weight_update_group"))
    async def init_weight_update_group(
        body: Annotated[protocol.InitWeightUpdateGroupBody, json_body(protocol.InitWeightUpdateGroupBody)],
    ) -> dict:
        return {"group_ranks": await engine.init_weight_update_group(**body.model_dump())}

    @router.post(path("update_weights_from_distributed"))
    async def update_weights_from_distributed(
        body: Annotated[protocol.UpdateFromDistributedBody, json_body(protocol.UpdateFromDistributedBody)],
    ) -> dict:
        options = body.model_dump(exclude={"names", "dtypes", "shapes"})
        dtypes = [_dtype(name) for name in body.dtypes]
        async with push_turns.turn():
            version = await engine.update_weights_from_distributed(body.names, dtypes, body.shapes, **options)
        return {"weight_version": version}

    @router.post(path("check_weight_update"))
    async def check_weight_update(
        body: Annotated[protocol.CheckWeightUpdateBody, json_body(protocol.CheckWeightUpdateBody)],
    ):
        dtypes = [_dtype(name) for name in body.dtypes]
        await engine.check_weight_update(body.names, dtypes, body.shapes, body.component)
        return {"ok": True}

    worker_cls = engine.engine.executor.worker_cls
    callable_by_name = functions_marked(worker_cls, READ_ONLY) | settings.rpc_allow

    @router.post(path("collective_rpc"))
    async def collective_rpc(
        body: Annotated[protocol.CollectiveRpcBody, json_body(protocol.CollectiveRpcBody)],
    ) -> dict:
        if body.method not in callable_by_name and body.method in worker_functions(worker_cls):
            raise HTTPException(403, _rpc_refusal(worker_cls, body.method))
        results = await engine.collective_rpc(
            body.method, args=body.args, kwargs=body.kwargs, timeout=body.timeout, ranks=body.ranks
        )
        try:
            json.dumps(results)
        except TypeError as error:
            raise HTTPException(
                500,
                f"worker method {body.method!r} returned values that are not JSON ({error}); over HTTP, "
                "return plain values (numbers, strings, lists, dicts)",
            ) from None
        return {"results": results}

    app.include_router(router)
    return app


# Worker functions by name.

# The engine's own route for what a state-changing worker function does (from its mark).
_ENGINE_ROUTES = {name: path(api_method) for name, api_method in engine_routes(Worker).items()}


def _rpc_refusal(worker_cls: type, method: str) -> str:
    """Over HTTP a client reaches a function that may change state only through the engine, which
    keeps its effects in its books (sleep level, weight version, adapters), or where the operator
    allowed it. A function of the extension says what it does with its mark (`rollout.worker.marks`)."""
    if mark_of(getattr(worker_cls, method)) == STAGES_WEIGHTS:
        return (
            f"worker function {method!r} stages weights: call {path('update_weights_from_worker')}, which applies "
            "them on every rank or on none, with a new weight version"
        )
    if method not in worker_functions(Worker):
        return (
            f"worker function {method!r} of --worker-extension-cls is not marked @read_only, so it may change what "
            "the engine keeps and /collective_rpc does not call it: mark it with rollout.worker.marks.read_only if "
            f"it only reads, or start the server with --rpc-allow {method}"
        )
    route = _ENGINE_ROUTES.get(method)
    instead = f"use {route}, which keeps the engine's record of it" if route else "the engine does this itself"
    return (
        f"worker method {method!r} changes state the engine keeps, so /collective_rpc does not call it: {instead}; "
        f"or start the server with --rpc-allow {method} if you accept that the engine's record may be wrong"
    )


# Bodies.

_ANSWER_THREADS = 2
# The live check waits for the step in progress (up to a second or more on a loaded machine): the
# answer promised within a second came after this wait plus the loop's and the client's share of
# a busy machine (up to 1.75 s under 32 clients, when this was the whole second). Since the answers'
# encoding left the loop: 0.27-0.93 s at worst with 64 clients on mp and six CPU-bound processes
# beside the server on 2 cores (docs/service.md).
_HEALTH_WAIT_S = 0.25


def _sampling_params(params) -> SamplingParams | list[SamplingParams]:
    if params is None:
        return protocol.to_sampling_params(protocol.SamplingParamsBody())
    if isinstance(params, list):
        return [protocol.to_sampling_params(p) for p in params]
    return protocol.to_sampling_params(params)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype name; use e.g. 'float32' or 'bfloat16'")
    return dtype


def _name_of(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return f"{value.__module__}.{value.__qualname__}"


# Outputs.


def _frames(request_ids: list[str], outputs) -> bytes:
    encoder = OutputEncoder()
    return frame("requests", {"request_ids": request_ids}) + b"".join(encoder.encode(o) for o in outputs)


async def _stream_frames(stream: OutputStream, share: Share | None, answers: Executor) -> AsyncIterator[bytes]:
    """Frames of `stream` as its outputs finish, each encoded on `answers`. A closed connection
    cancels this generator, and leaving the `async with` aborts what is left; then the images'
    `share` is given back."""
    encoder = OutputEncoder()  # used by one thread at a time: each output's encode is awaited
    loop = asyncio.get_running_loop()
    try:
        async with stream:
            yield frame("requests", {"request_ids": stream.request_ids})
            try:
                async for output in stream:
                    yield await loop.run_in_executor(answers, encoder.encode, output)
            except Exception as error:  # the status line has gone out: the client reads the error frame
                logger.warning("a generate stream failed: %s", error)
                yield error_frame(error)
    finally:
        if share is not None:
            share.give_back()


async def _collect(stream: OutputStream, request: Request) -> list:
    """Every output of `stream`, in request order; aborts them if the client goes away first."""
    outputs = {}
    async with stream:
        iterator = aiter(stream)
        while len(outputs) < len(stream.request_ids):
            next_output = asyncio.ensure_future(anext(iterator))
            while not next_output.done():
                await asyncio.wait({next_output}, timeout=1.0)
                if not next_output.done() and await request.is_disconnected():
                    next_output.cancel()
                    return []  # leaving the block aborts the requests
            output = next_output.result()
            outputs[output.request_id] = output
    return [outputs[request_id] for request_id in stream.request_ids]


# Auth and errors.


def _error_body(status: int, error_type: str, message: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"type": error_type, "message": message}}, status_code=status, headers=headers)


def _error_handler(status: int):
    async def handle(request: Request, error: Exception) -> JSONResponse:
        if status >= 500:
            logger.error("%s %s failed: %s", request.method, request.url.path, error)
        return _error_body(status, type(error).__name__, str(error))

    return handle


async def _worker_error(request: Request, error: WorkerError) -> JSONResponse:
    """A worker function raised: 400 for the caller's bad input (a ValueError or TypeError in the
    worker), else 500. The body has the worker's error, and under "worker" what the client needs
    to raise the `WorkerError` an engine in its process would (`worker_error_fields`)."""
    status = 400 if error.raised(ValueError) or error.raised(TypeError) else 500
    log = logger.warning if status < 500 else logger.error
    log("%s %s failed in a worker: %s", request.method, request.url.path, error)
    message = f"worker rank {error.rank}: {error.message}"
    body = {"type": error.error_type.rpartition(".")[2], "message": message, "worker": worker_error_fields(error)}
    return JSONResponse({"error": body}, status_code=status)


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    return _error_body(error.status_code, "HTTPError", str(error.detail), error.headers)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return _error_body(422, "ValidationError", describe(error))
