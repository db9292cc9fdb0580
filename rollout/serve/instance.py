"""Which server answered: a rollout server makes an instance id at its start and stamps it on every
answer, so that a client never mistakes a restarted server (its weights, adapters and requests
gone, its weight_version back to 0) for the one it was talking to.

On every answer that passes the app (errors, 404s, refusals, streams and /health included) the
server sets `X-Rollout-Instance` (its id) and `X-Rollout-Weight-Version` (its weight version as the
answer starts, so a client can say what a restart cost). A request that carries `X-Rollout-Instance`
is for that instance only: another one answers 412 without running it, so a weight push meant for
the old server never lands on a new one.

The client (`InstanceCheck`) learns the id from its first answer, or is given it, sends it on every
request, and fails for good on an answer from another instance, until its user accepts the new one.
A success answer without the header is refused: accepting it would let an older server, or a proxy
that drops the header, restart unnoticed (an error answer without it, such as uvicorn's own 503 or
a proxy's 502, is the error its body says).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout.errors import EngineDeadError
from rollout.http.wire import WireError

INSTANCE_HEADER = "x-rollout-instance"
WEIGHT_VERSION_HEADER = "x-rollout-weight-version"


def new_instance_id() -> str:
    """A random id and the start time (UTC), e.g. '3f2a9c0d1e4b5a67-20261201T192839Z': the random
    part tells two servers apart, the time tells a reader which one is the newer."""
    return f"{secrets.token_hex(8)}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"


class InstanceHeaders:
    """ASGI middleware of the server: stamps the instance headers on every answer, and refuses
    (412) a request addressed to another instance."""

    def __init__(self, app: ASGIApp, instance_id: str, weight_version: Callable[[], int]):
        self.app = app
        self.instance_id = instance_id
        self.weight_version = weight_version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                stamp = [
                    (INSTANCE_HEADER.encode(), self.instance_id.encode()),
                    (WEIGHT_VERSION_HEADER.encode(), str(self.weight_version()).encode()),
                ]
                message = {**message, "headers": [*message.get("headers", ()), *stamp]}
            await send(message)

        addressed_to = Headers(scope=scope).get(INSTANCE_HEADER)
        if addressed_to is not None and addressed_to != self.instance_id:
            message = (
                f"this request was sent to rollout server instance {addressed_to}, but this is instance "
                f"{self.instance_id} (the server restarted, or another one answers at this address): it was not "
                "run. The weights, adapters and requests that client knew are not here; accept this server "
                "(RemoteRolloutEngine.reconnect(), or a new client) and push the weights again"
            )
            response = JSONResponse({"error": {"type": "EngineDeadError", "message": message}}, status_code=412)
            await response(scope, receive, stamped)
            return
        await self.app(scope, receive, stamped)


class InstanceCheck:
    """The client's side, for the server at `url`: `instance_id` is the one it talks to (None until
    the first answer names it), `weight_version` the last one an answer of it carried."""

    def __init__(self, url: str, instance_id: str | None = None):
        self.url = url
        self.instance_id = instance_id
        self.weight_version: int | None = None
        self.restart: str | None = None  # what EngineDeadError says once another instance answered

    def request_headers(self) -> dict[str, str]:
        """The headers of the next request; raises the restart's EngineDeadError once one was seen,
        so nothing more is sent to a server this client does not know."""
        if self.restart is not None:
            raise EngineDeadError(self.restart)
        return {INSTANCE_HEADER: self.instance_id} if self.instance_id is not None else {}

    def check(self, status: int, headers: Mapping[str, str], what: str) -> None:
        """Check one answer (`what`: "GET /server_info", for messages) before its body is read."""
        instance_id = headers.get(INSTANCE_HEADER)
        if instance_id is None:
            if status < 400:
                raise WireError(
                    f"the answer of {self.url} to {what} carries no {INSTANCE_HEADER} header, so this client "
                    "cannot tell whether that server restarted (losing its weights and adapters): the server is "
                    "older than this client (run the same version on both), or a proxy between them drops the "
                    f"header (let it pass {INSTANCE_HEADER} and {WEIGHT_VERSION_HEADER})"
                )
            return  # an error all the same (uvicorn's own 503, a proxy's 502): the caller raises it
        weight_version = headers.get(WEIGHT_VERSION_HEADER)
        if self.instance_id is None:
            self.instance_id = instance_id
        elif instance_id != self.instance_id:
            before = "an unknown version" if self.weight_version is None else str(self.weight_version)
            self.restart = (
                f"the rollout server at {self.url} restarted, or another server answers there now (instance "
                f"{self.instance_id} → {instance_id}): its weights, adapters and requests are gone; weight_version "
                f"went from {before} to {weight_version}. Resume the run (the recipes push their weights again on "
                "resume), or call reconnect() (or create a new RemoteRolloutEngine) to work with the new server"
            )
            raise EngineDeadError(self.restart)
        if weight_version is not None and weight_version.isdigit():
            self.weight_version = int(weight_version)
