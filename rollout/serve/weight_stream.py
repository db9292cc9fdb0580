"""A full-weight push over HTTP as a stream of buckets, both sides: the body is never held whole.

The body (Content-Type `FRAMES_MEDIA_TYPE`) is a stream of frames (`rollout.http.wire`):
1. {"kind": "update_weights", "request": {...}}: the route's options (`UpdateFromTensorBody`), first;
2. {"kind": "bucket"}: tensors of about `bucket_bytes` together, as many frames as it takes;
3. {"kind": "end", "tensors": n}: how many tensors the buckets held. A body that stops without it
   was cut off, and is refused like any other bad body.

The client writes the frames lazily from the tensors (`weight_frames`: views of their memory, no
join). The server cuts each frame into a buffer of its own as it arrives (on its own HTTP protocol,
read from the socket straight into that buffer: `rollout.http.frame_body`), and hands its tensors
(views of that buffer, which nothing else holds) over to the engine, a bucket per call between two
engine steps (`RolloutEngine.open_weight_push`; `HandedOver`: the in-process executor stages them
without a copy), which checks and stages them while the next frame arrives (`receive_update`). So
the server holds the staged update plus about a bucket, not the body, its parse and the update;
and the engine generates on while the body arrives: a body that trickled in held every generation
for as long as it trickled, when the whole push was one engine call that waited for its buckets.
The body must arrive whole within --upload-timeout-s, and while another update waits its turn
(`rollout.serve.push_turns`), each frame within --body-timeout-s.

All-or-nothing, as in process: whatever goes wrong before the end frame (a body cut off, stalled
past --body-timeout-s, past --upload-timeout-s, over --max-upload-mb, a malformed frame, a tensor
the engine refuses) drops what the engine staged, and the weights and version stay. The answer
waits for that rollback. Only applying the update pauses generation.
"""

from __future__ import annotations

import asyncio
import json
import mmap
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping

import torch
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from rollout.engine.async_engine import AsyncRolloutEngine
from rollout.http.frame_body import FRAME_BODY_EXTENSION
from rollout.http.frame_views import FrameAssembler, FrameTooLarge, frame_pieces, tensors_from_buffer
from rollout.http.request_body import body_chunks, too_big
from rollout.http.wire import WireError
from rollout.serve import protocol
from rollout.serve.push_turns import PushTurns
from rollout.weights.handed_over import HandedOver

UPLOAD_FLAG = "--max-upload-mb"


# The client's side.


def weight_frames(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], options: dict, bucket_bytes: int
) -> Iterator[bytes | memoryview]:
    """The body of a streamed push: its options, the tensors in buckets of about `bucket_bytes`
    (read from `named_tensors` as the body is sent), then the end frame."""
    yield from frame_pieces("update_weights", {"request": options})
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    bucket: dict[str, torch.Tensor] = {}
    size = count = 0
    for name, tensor in items:
        if name in bucket:  # one frame cannot name it twice; the engine refuses repeats across buckets
            raise ValueError(f"update refused: {name!r} is given twice; send each tensor once")
        bucket[name] = tensor
        size += tensor.numel() * tensor.element_size()
        count += 1
        if size >= bucket_bytes:
            yield from frame_pieces("bucket", tensors=bucket)
            bucket, size = {}, 0
    if bucket:
        yield from frame_pieces("bucket", tensors=bucket)
    yield from frame_pieces("end", {"tensors": count})


# The server's side.


async def receive_update(
    request: Request,
    engine: AsyncRolloutEngine,
    limit: int,
    idle_timeout_s: float,
    deadline_s: float,
    turns: PushTurns,
) -> int:
    """Apply the streamed push in `request`'s body; returns the new weight version. Raises the
    body's own error (HTTPException 408/413, WireError, a 422 for bad options) or the engine's,
    after the engine has dropped whatever it staged. The body must arrive whole within
    `deadline_s` of its first read (408 past it, and the connection is closed), and while another
    update waits its turn, each frame within `turns.hurried_frame_s`. The engine stages one push at
    a time (`RolloutEngine.open_weight_push`): the next one waits for its turn, its body unread,
    rather than being refused."""
    async with turns.turn():
        return await _receive_update(request, engine, limit, idle_timeout_s, _BodyDue(turns, deadline_s))


async def _receive_update(
    request: Request, engine: AsyncRolloutEngine, limit: int, idle_timeout_s: float, due: _BodyDue
) -> int:
    frames = _frames(_frame_buffers(request, limit, idle_timeout_s))
    try:
        options = _options(await due.next(frames))
        push = await engine.open_weight_push(
            component=options.component,
            check_finite=options.check_finite,
            bucket_bytes=options.bucket_bytes,
            version=options.version,
            delta=options.delta,
        )
        try:
            await _stage_buckets(frames, engine, push, due)
        except BaseException as error:  # the body failed, or the engine's staging did: drop what it staged
            await engine.abort_weight_push(push, error)
            if not isinstance(error, _StagingFailed):
                raise
            await _discard(frames, due)  # read the rest, so that the client gets to read the answer
            raise error.cause from None
        return await engine.finish_weight_push(push, version=options.version, mode=options.mode)
    finally:
        await frames.aclose()


def _options(first: tuple[dict, dict] | None) -> protocol.UpdateFromTensorBody:
    if first is None:
        raise WireError("the body is empty; a streamed push starts with its 'update_weights' frame")
    fields, tensors = first
    if fields.get("kind") != "update_weights" or tensors:
        raise WireError(f"a streamed push starts with its 'update_weights' frame, not {fields.get('kind')!r}")
    try:
        return protocol.UpdateFromTensorBody.model_validate_json(json.dumps(fields.get("request", {})))
    except ValidationError as error:  # the app's handler answers 422 naming each field
        raise RequestValidationError(error.errors()) from None


def _frame_buffers(request: Request, limit: int, idle_timeout_s: float) -> AsyncIterator[bytearray | mmap.mmap]:
    frame_body = request.scope.get("extensions", {}).get(FRAME_BODY_EXTENSION)
    if frame_body is not None:  # the server's protocol reads it from the socket into the frames
        return frame_body.frames(limit, UPLOAD_FLAG, idle_timeout_s)
    return _assembled(body_chunks(request, limit, UPLOAD_FLAG, idle_timeout_s), limit)


async def _assembled(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytearray | mmap.mmap]:
    """The buffer of each frame of the body as it completes: a body that the server's protocol did
    not read itself (one sent with a Content-Length, or on another ASGI server)."""
    assembler = FrameAssembler(limit)
    try:
        async for chunk in chunks:
            for buffer in assembler.feed(chunk):
                yield buffer
        assembler.close()
    except FrameTooLarge:
        raise too_big(limit, UPLOAD_FLAG) from None
    finally:
        assembler.release()  # a frame cut off by the body's failure, freed now
        await chunks.aclose()


async def _frames(buffers: AsyncIterator[bytearray | mmap.mmap]) -> AsyncIterator[tuple[dict, dict]]:
    """(fields, tensors) of each frame as it completes; tensors view the frame's own buffer."""
    try:
        async for buffer in buffers:
            tensors, fields = tensors_from_buffer(buffer, "a frame of the body")
            del buffer  # the tensors hold it: once they are staged, nothing else does
            yield fields, tensors
    finally:
        await buffers.aclose()


class _BodyDue:
    """When a streamed push's frames must come: all within `deadline_s` of the first read, and
    each within the hurried time while another update waits its turn (`PushTurns`)."""

    def __init__(self, turns: PushTurns, deadline_s: float):
        self.turns, self.deadline_s = turns, deadline_s
        self.arrive_by = asyncio.get_running_loop().time() + deadline_s

    async def next(self, frames: AsyncIterator[tuple[dict, dict]]) -> tuple[dict, dict] | None:
        """The body's next frame, or None at its end; a 408 once it is due and has not come."""
        due = self.turns.frame_due(self.arrive_by)
        try:
            async with asyncio.timeout_at(due) as timeout:
                with self.turns.waiting_for_frame(timeout):
                    return await anext(frames, None)
        except TimeoutError:
            if timeout.when() < self.arrive_by:
                message = (
                    "another weight update waited for its turn, and this push's next frame did not come within "
                    f"{self.turns.hurried_frame_s} s (--body-timeout-s); send a push's buckets at the link's speed"
                )
            else:
                message = f"the push's body did not arrive whole within {self.deadline_s} s (--upload-timeout-s)"
            # What is left of it is not waited for.
            raise HTTPException(408, message, headers={"Connection": "close"}) from None


async def _stage_buckets(
    frames: AsyncIterator[tuple[dict, dict]], engine: AsyncRolloutEngine, push, due: _BodyDue
) -> None:
    """Stage each bucket as it arrives, a call between two engine steps each, until the end frame
    and the end of the body. One bucket is staged while the next arrives: that is the overlap of
    network and staging, and the bound on what the body holds in memory."""
    sent, staging = 0, None
    try:
        while (frame := await due.next(frames)) is not None:
            fields, tensors = frame
            del frame
            kind = fields.get("kind")
            if kind == "end":
                expected = fields.get("tensors")
                if await due.next(frames) is not None:
                    raise WireError("the body goes on after its 'end' frame")
                if expected != sent:
                    raise WireError(f"the body's 'end' frame counts {expected!r} tensors, but its buckets held {sent}")
                return
            if kind != "bucket":
                raise WireError(f"a streamed push holds 'bucket' frames, then an 'end' frame; got {kind!r}")
            if staging is not None:
                await _staged(staging)
            # Views of the frame's own buffer, which nothing else holds: an in-process worker keeps them.
            staging = asyncio.ensure_future(engine.add_to_weight_push(push, HandedOver(tensors)))
            sent += len(tensors)
            del tensors
        raise WireError(f"the body was cut off after {sent} tensors, before its 'end' frame")
    finally:
        if staging is not None:
            await asyncio.wait({staging})
            if not staging.cancelled() and staging.exception() is not None:
                raise _StagingFailed(staging.exception())


async def _staged(staging: asyncio.Future) -> None:
    try:
        await staging
    except Exception as error:
        raise _StagingFailed(error) from None


class _StagingFailed(Exception):
    """The engine failed to stage a bucket (a worker failed): its error is the answer."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


async def _discard(frames: AsyncIterator, due: _BodyDue) -> None:
    """Read the rest of a body that will not be used, so the client gets to read the answer."""
    try:
        while await due.next(frames) is not None:
            pass
    except Exception:  # the answer is the engine's error; what else is wrong with the body is moot
        return
