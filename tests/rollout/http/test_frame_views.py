"""Frames written in pieces and read back as views (`rollout.http.frame_views`): the same frames as
`rollout.http.wire` writes, bitwise, however the stream is cut; anything malformed is a WireError."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from rollout.http.frame_views import FrameAssembler, FrameTooLarge, frame_buffer, frame_pieces, tensors_from_buffer
from rollout.http.wire import LENGTH, FrameReader, WireError, tensors_to_bytes

pytestmark = pytest.mark.timeout(60)


def _pieced(tensors: dict) -> bytes:
    return b"".join(frame_pieces("bucket", {"n": len(tensors)}, tensors))


def test_frames_in_pieces_are_safetensors_frames_and_are_read_back_as_views():
    """What `frame_pieces` writes is a frame any reader decodes; `FrameAssembler` cuts it however
    the stream is chunked, and `tensors_from_buffer` views the frame's own buffer, bitwise."""
    tensors = {
        "f32": torch.randn(5, 7),
        "bf16": torch.randn(3, 4).to(torch.bfloat16),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "strided": torch.randn(4, 6).t(),  # made contiguous on the way
    }
    data = _pieced(tensors)
    [(fields, decoded)] = FrameReader().feed(data)  # safetensors' own parser agrees
    assert fields == {"kind": "bucket", "n": 6}
    assert all(torch.equal(decoded[name], tensor) for name, tensor in tensors.items())
    for chunk_size in (1, 7, len(data)):
        assembler, buffers = FrameAssembler(max_frame_bytes=len(data)), []
        for start in range(0, len(data) * 2, chunk_size):  # two frames back to back
            buffers += assembler.feed((data + data)[start : start + chunk_size])
        assembler.close()
        assert len(buffers) == 2
        views, fields = tensors_from_buffer(buffers[1], "a frame")
        assert fields["kind"] == "bucket"
        for name, tensor in tensors.items():
            assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor)
    buffers[1][:] = bytes(len(buffers[1]))  # views, not copies: they see their buffer change
    assert not views["f32"].any() and not views["bf16"].any()


def test_a_big_frame_buffer_is_mapped_memory_that_tensors_can_view():
    small, big = frame_buffer(100), frame_buffer(4 << 20)
    assert isinstance(small, bytearray) and len(big) == 4 << 20
    big[8:16] = torch.tensor([1.5, -2.0]).numpy().tobytes()
    assert torch.equal(torch.frombuffer(big, dtype=torch.float32, count=2, offset=8), torch.tensor([1.5, -2.0]))


def test_frames_too_long_or_cut_or_malformed_are_wire_errors():
    data = _pieced({"w": torch.randn(8)})
    with pytest.raises(FrameTooLarge, match="over the limit of 10"):
        list(FrameAssembler(max_frame_bytes=10).feed(data))
    assembler = FrameAssembler(max_frame_bytes=len(data))
    assert list(assembler.feed(data[:-3])) == []
    with pytest.raises(WireError, match="ended inside a frame"):
        assembler.close()
    header = json.dumps({"__metadata__": {"frame": "{}"}, "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}})
    wrong_size = bytearray(len(header).to_bytes(8, "little") + header.encode() + bytes(8))
    with pytest.raises(WireError, match="does not fit its data offsets"):
        tensors_from_buffer(wrong_size, "a frame")
    no_frame = bytearray(tensors_to_bytes({"w": torch.zeros(2)}))
    with pytest.raises(WireError, match="no valid 'frame' metadata"):
        tensors_from_buffer(no_frame, "a frame")


def test_a_big_frame_is_read_into_mapped_memory_bitwise():
    tensors = {"big": torch.randn(800, 1024), "bias": torch.randn(1024).to(torch.bfloat16)}
    data = b"".join(frame_pieces("bucket", None, tensors))
    assembler = FrameAssembler(max_frame_bytes=len(data))
    [buffer] = [b for start in range(0, len(data), 65536) for b in assembler.feed(data[start : start + 65536])]
    views, _ = tensors_from_buffer(buffer, "a frame")
    assert not isinstance(buffer, bytearray)  # over 2 MiB: mapped
    assert all(torch.equal(views[name], tensor) for name, tensor in tensors.items())


def test_a_big_frame_keeps_what_is_written_while_its_pages_are_faulted_in():
    import threading
    import time

    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assembler = FrameAssembler(max_frame_bytes=data.numel())
    assert list(assembler.feed(LENGTH.pack(data.numel()))) == []
    view, frames = memoryview(data.numpy()), []
    for start in range(0, len(view), 256 << 10):  # past an eighth, its pages are faulted in on a thread
        frames += assembler.feed(view[start : start + (256 << 10)])
    deadline = time.monotonic() + 60
    while any(t.name == "rollout-prefault" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    [buffer] = frames
    assert torch.equal(torch.frombuffer(buffer, dtype=torch.uint8), data)


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_frame_takes_memory_as_its_bytes_come_and_release_gives_it_back():
    """A frame announcing 1 GiB costs what has come and at most 32 MiB more (an eighth of it, at
    most 32 MiB, faulted in ahead of its bytes); once its first 32 MiB had come, the whole GiB was
    faulted in, and held for as long as the sender took. `release` frees it at once, not at a
    garbage collection."""
    piece = bytes(1 << 20)
    assembler, before = FrameAssembler(max_frame_bytes=1 << 30), _rss_mb()
    list(assembler.feed(LENGTH.pack(1 << 30) + piece))
    time.sleep(1.0)  # the window ahead is faulted in
    assert _rss_mb() - before < 40  # 1 MiB came, and the window ahead of it
    for _ in range(63):  # 64 MiB in all, past the 32 MiB after which the whole frame was faulted in
        list(assembler.feed(piece))
    deadline, held = time.monotonic() + 3, []
    while time.monotonic() < deadline:  # the faulting thread catches up with the window, and stops there
        held.append(_rss_mb() - before)
        time.sleep(0.05)
    assert 60 < max(held) < 64 + 32 + 16, max(held)  # before: up to 1024
    assembler.release()
    assert _rss_mb() - before < 50
    assert list(assembler.feed(LENGTH.pack(8) + bytes(8))) == [bytearray(8)]  # and it reads on
