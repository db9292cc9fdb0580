"""What every HTTP request must show before any route (or the key check) sees it: a `Host` header
that names this server, and on a POST a body type of JSON (`application/json`), safetensors
(`application/octet-stream`) or frames of tensors (`rollout.http.wire.FRAMES_MEDIA_TYPE`); and the key
check itself (`require_api_key`), which the rollout and reward services share.

Both close a door a web page would otherwise have into a server on the same machine: DNS rebinding
points the attacker's own host name at 127.0.0.1 (the browser then sends that name as `Host`),
and a page may POST `text/plain` or form bodies to any origin without a CORS preflight, while
these two types need one, which this server never grants.
"""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout.http.wire import FRAMES_MEDIA_TYPE, SAFETENSORS_MEDIA_TYPE

BODY_TYPES = ("application/json", SAFETENSORS_MEDIA_TYPE, FRAMES_MEDIA_TYPE)


class RequestGuard:
    """ASGI middleware: refuses (400, 415) a request whose Host or body type is not allowed, in the
    service's error format."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope["method"], Headers(scope=scope))
            if refusal is not None:
                status, message = refusal
                body = {"error": {"type": "HTTPError", "message": message}}
                await JSONResponse(body, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, method: str, headers: Headers) -> tuple[int, str] | None:
        host = _host_name(headers.get("host", ""))
        if self.hosts is not None and host not in self.hosts:
            return 400, (
                f"the Host header {headers.get('host', '')!r} does not name this server (it answers to "
                f"{', '.join(sorted(self.hosts))}); a web page may be rebinding a DNS name to it. If you reach "
                "the server by another name, start it with --allowed-host NAME"
            )
        if method in ("POST", "PUT", "PATCH"):
            media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media_type not in BODY_TYPES:
                return 415, (
                    f"a {method} body must be sent as application/json (or application/octet-stream for "
                    f"safetensors, {FRAMES_MEDIA_TYPE} for a streamed push), got Content-Type {media_type or 'none'!r}"
                )
        return None


def _host_name(host: str) -> str:
    """The name of a Host header without its port: `127.0.0.1:8000` -> `127.0.0.1`, `[::1]:80` -> `::1`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() and ":" not in name else host


def require_api_key(api_key: str | None):
    """A FastAPI dependency: 401 without `Authorization: Bearer <key>`, 403 with another key (compared in
    constant time); None: no key is asked for."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            missing = "missing API key: send 'Authorization: Bearer <key>'"
            raise HTTPException(401, missing, {"WWW-Authenticate": "Bearer"})
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            raise HTTPException(403, "wrong API key")

    return check
