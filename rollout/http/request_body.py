"""A request body read within the server's limits: at most `limit` bytes (413 past it), each chunk
within `idle_timeout_s` of the last (408 past it: a client that stops sending mid-body would hold
its connection forever). Every route's body goes through `body_chunks`, whole or streamed, but a
streamed weight push's on the server's own HTTP protocol (`rollout.http.frame_body`), under the
same limits and errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import HTTPException, Request
from starlette.requests import ClientDisconnect


def too_big(limit: int, flag: str) -> HTTPException:
    return HTTPException(413, f"the request body is over this server's limit of {limit} bytes ({flag})")


def stalled(idle_timeout_s: float, size: int) -> HTTPException:
    return HTTPException(408, f"the request body stalled for {idle_timeout_s} s after {size} bytes (--body-timeout-s)")


def client_went_away(size: int) -> HTTPException:
    return HTTPException(400, f"the client went away after {size} bytes of the body")


async def body_chunks(request: Request, limit: int, flag: str, idle_timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; `flag` is the command-line flag that sets `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big(limit, flag)
    size = 0
    stream = aiter(request.stream())
    while True:
        try:
            # asyncio.timeout, not wait_for: no task per chunk (a 1 GB body is ~10^4 chunks).
            async with asyncio.timeout(idle_timeout_s):
                chunk = await anext(stream)
        except StopAsyncIteration:
            return
        except ClientDisconnect:
            raise client_went_away(size) from None
        except TimeoutError:
            raise stalled(idle_timeout_s, size) from None
        size += len(chunk)
        if size > limit:
            raise too_big(limit, flag)
        if chunk:
            yield chunk


async def read_body(request: Request, limit: int, flag: str, idle_timeout_s: float) -> bytes:
    """The whole body, within the limits of `body_chunks`."""
    return b"".join([chunk async for chunk in body_chunks(request, limit, flag, idle_timeout_s)])
