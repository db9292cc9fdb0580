"""How the service's routes read their bodies: within the server's limits (`BodyLimits`), the
large ones parsed off the event loop (on the admission's threads), errors worded once.

A JSON body is at most --max-body-mb. A body of tensors (one safetensors file, its options in the
metadata "request") is at most --max-upload-mb and must arrive whole within --upload-timeout-s; a
generate's, which carries input images, is held to what a generate may use: its header (the
request's JSON and the images' entries) to a JSON body's limit, measured as its first 8 bytes
arrive, and the rest to what its images may take. Bounded by --max-upload-mb alone, 10 MB of JSON in
its metadata was read and parsed before it was refused (1.0 s and +170-250 MB of RSS on a test
server, 4.2 s and 324 MB in the issue's probe), where the JSON route refuses it at once.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from fastapi import Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from rollout.http.request_body import body_chunks, read_body
from rollout.http.wire import LENGTH, tensors_from_bytes
from rollout.request_limits import RequestLimits
from rollout.serve import protocol
from rollout.serve.admission import Admission
from rollout.serve.weight_stream import UPLOAD_FLAG

_PARSE_IN_THREAD_BYTES = 64 << 10
_MOST_BYTES_PER_PIXEL = 8  # a 16-bit RGBA PNG's, which random pixels do not shrink
_PNG_OVERHEAD_BYTES = 1 << 20  # a PNG's chunks, filter bytes and zlib framing, over its pixels
_MOST_BYTES_DISCARDED = 64 << 20  # of a refused body, so that its client reads the refusal
Limit = tuple[int, str]  # bytes, and the flags that set them (for the 413's message)


class BodyLimits(Protocol):
    """The server's limits on bodies (`rollout.serve.app.ServerSettings` has them)."""

    max_body_bytes: int
    max_upload_bytes: int
    body_timeout_s: float
    upload_timeout_s: float


class RequestBodies:
    """The body readers of one server."""

    def __init__(self, settings: BodyLimits, admission: Admission):
        self.settings, self.admission = settings, admission

    def json_dependency(self, model: type[BaseModel]):
        """A route parameter's default: the request's JSON body, checked by `model`."""

        async def parse(request: Request) -> BaseModel:
            return await self.json(request, model)

        return Depends(parse)

    async def json(self, request: Request, model: type[BaseModel]) -> BaseModel:
        settings = self.settings
        raw = await read_body(request, settings.max_body_bytes, "--max-body-mb", settings.body_timeout_s)
        try:
            if len(raw) > _PARSE_IN_THREAD_BYTES:  # off the event loop, so every route keeps answering
                return await self.admission.check(model.model_validate_json, raw)
            return model.model_validate_json(raw or b"{}")
        except ValidationError as error:
            raise HTTPException(422, describe(error)) from None

    async def tensors(
        self, request: Request, model: type[BaseModel], limit: Limit | None = None, header_limit: Limit | None = None
    ):
        """The tensors of a safetensors body and its options (metadata "request", checked by
        `model`). `limit`: of the whole body, --max-upload-mb's by default; `header_limit`: of its
        header (the options and the tensors' entries), none by default."""
        settings = self.settings
        limit = limit or (settings.max_upload_bytes, UPLOAD_FLAG)
        try:
            async with asyncio.timeout(settings.upload_timeout_s):
                raw = await _read_tensor_body(request, limit, header_limit, settings.body_timeout_s)
        except TimeoutError:
            message = f"the body did not arrive whole within {settings.upload_timeout_s} s (--upload-timeout-s)"
            raise HTTPException(408, message, headers={"Connection": "close"}) from None
        tensors, metadata = await self.admission.read(tensors_from_bytes, raw, "the request body")
        try:
            options = model.model_validate_json(metadata.get("request", "{}"))
        except ValidationError as error:
            raise HTTPException(422, "the body's metadata 'request': " + describe(error)) from None
        return tensors, options

    def generate_limits(self, limits: RequestLimits) -> tuple[Limit, Limit]:
        """(whole body, header) limits of a generate's safetensors body: its JSON and the images'
        entries within a JSON body's limit, and images of at most 8 bytes a pixel (a 16-bit RGBA
        PNG that does not compress), as many and as large as the request limits take."""
        settings = self.settings
        images = limits.max_input_images * (_MOST_BYTES_PER_PIXEL * limits.max_input_pixels + _PNG_OVERHEAD_BYTES)
        body, flags = settings.max_body_bytes + images, "--max-body-mb, --max-input-images, --max-input-pixels"
        if settings.max_upload_bytes < body:
            body, flags = settings.max_upload_bytes, UPLOAD_FLAG
        return (body, flags), (settings.max_body_bytes, "--max-body-mb, as a JSON body's")


async def _read_tensor_body(
    request: Request, limit: Limit, header_limit: Limit | None, idle_timeout_s: float
) -> bytes:
    """A safetensors body, read whole; its header's length is checked as soon as it has come."""
    chunks, size = [], 0
    body = body_chunks(request, *limit, idle_timeout_s)
    async for chunk in body:
        chunks.append(chunk)
        size += len(chunk)
        if header_limit is not None and size >= LENGTH.size:
            (header_bytes,) = LENGTH.unpack_from(b"".join(chunks)[: LENGTH.size])
            if header_bytes > header_limit[0]:
                await _discard(body, _MOST_BYTES_DISCARDED)
                raise HTTPException(
                    413,
                    f"the body's safetensors header (its metadata 'request' and the tensors' entries) is "
                    f"{header_bytes} bytes, over this server's limit of {header_limit[0]} ({header_limit[1]})",
                    headers={"Connection": "close"},  # what is left past _MOST_BYTES_DISCARDED is not read
                )
            header_limit = None
    return b"".join(chunks)


async def _discard(body, most_bytes: int) -> None:
    """Read and drop up to `most_bytes` more of a refused body. A server that closes its connection
    with the client's bytes unread makes the kernel reset it, and the reset can destroy the answer
    before the client reads it (a 413 seen as "peer closed connection without sending complete
    message body" when 10 MB followed the header)."""
    discarded = 0
    try:
        async for chunk in body:
            discarded += len(chunk)
            if discarded >= most_bytes:
                return
    except HTTPException:  # the body stalled, went away or ran past its limit: the refusal stands
        return


def describe(error: ValidationError | RequestValidationError) -> str:
    """'field.path: problem' for each problem, e.g. "params.num_samples: Input should be a valid integer"."""
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"] if part not in ("body", *protocol.UNION_TAGS)) or "body"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field; remove it (see the README for this route's fields)"
        problems.append(f"{where}: {message}")
    return "invalid request body: " + "; ".join(problems)
