"""The reward service's routes: POST /score scores one group, GET /health says which rewards it serves.

POST /score takes the bytes `wire.encode_group` makes (a safetensors body: images as uint8
tensors or PNG files, prompts and metadata as JSON in its metadata) and answers JSON
{"total": [N], "components": {name: [N]}}. The body is read within the limits of the rollout
service (`rollout.http.request_body`), behind its guard and key check; nothing is unpickled.
Errors are JSON {"error": {"type", "message"}}: 400 for a body or a reward output that is wrong
(a NaN names the reward and the samples), 401/403 for the key, 503 when a reward worker died (the
pool restarts it; send the group again).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations.
import asyncio
import logging
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.http.guard import RequestGuard, require_api_key
from rollout.http.hosts import LOOPBACK_NAMES
from rollout.http.request_body import read_body
from trainers_adapters.rewards.runner import RewardRunner
from trainers_adapters.rewards.wire import decode_group, scores_to_json
from trainers_adapters.rewards.worker_queue import RewardWorkerDied

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardServiceSettings:
    """api_key: asked for as `Authorization: Bearer <key>` on /score (None: open); allowed_hosts:
    what a request's Host header may name (`rollout.http.hosts.allowed_hosts`); max_body_bytes
    and max_images: of one request; body_timeout_s: the longest pause inside a body."""

    api_key: str | None = None
    allowed_hosts: frozenset[str] | None = LOOPBACK_NAMES
    max_body_bytes: int = 256 << 20
    max_images: int = 1024
    body_timeout_s: float = 30.0


# Most specific first; anything else is a 500.
_STATUS_OF = [(RewardWorkerDied, 503), (ValueError, 400), (TypeError, 400)]


def build_reward_app(runner: RewardRunner, reward_names: list[str], settings: RewardServiceSettings) -> FastAPI:
    """The service's app over `runner`, which serves the rewards `reward_names` (shown by /health)."""
    app = FastAPI(title="diffusion-rollout reward service", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGuard, hosts=settings.allowed_hosts)
    for error_class, status in _STATUS_OF:
        app.add_exception_handler(error_class, _error_handler(status))
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _error_handler(500))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "rewards": reward_names}

    router = APIRouter(dependencies=[Depends(require_api_key(settings.api_key))])

    @router.post("/score")
    async def score(request: Request) -> dict:
        body = await read_body(request, settings.max_body_bytes, "--max-body-mb", settings.body_timeout_s)
        # Decoding (PNG files) and scoring are work: off the event loop, so /health keeps answering.
        images, prompts, metadata = await asyncio.to_thread(decode_group, body, settings.max_images)
        scores = await asyncio.wrap_future(runner.submit(images, prompts, metadata))
        return scores_to_json(scores)

    app.include_router(router)
    return app


def _error_body(status: int, error_type: str, message: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"type": error_type, "message": message}}, status_code=status, headers=headers)


def _error_handler(status: int):
    async def handle(request: Request, error: Exception) -> JSONResponse:
        (logger.error if status >= 500 else logger.warning)("%s %s: %s", request.method, request.url.path, error)
        return _error_body(status, type(error).__name__, str(error))

    return handle


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    return _error_body(error.status_code, "HTTPError", str(error.detail), error.headers)
