"""The chunked-body reader of streamed weight pushes (`rollout.http.chunked_frames`), alone: frames
come out whole however the chunks and the reads cut them (frame lengths and headers split
between chunks, chunk extensions, trailers, bytes of the next request after the body), and a
broken framing or too much data is refused naming the fault."""

from __future__ import annotations

import random

import pytest
import torch

from rollout.http.chunked_frames import BodyTooLarge, ChunkedFrameReader, MalformedChunks
from rollout.http.frame_views import FrameAssembler, FrameTooLarge, frame_pieces, tensors_from_buffer
from rollout.http.wire import LENGTH

pytestmark = pytest.mark.timeout(60)


def frames_of(count: int) -> list[bytes]:
    generator = torch.Generator().manual_seed(0)
    frames = []
    for index in range(count):
        tensors = {f"t{index}.{k}": torch.randn(k + 1, 3, generator=generator) for k in range(3)}
        frames.append(b"".join(frame_pieces("bucket", {"index": index}, tensors)))
    frames.append(b"".join(frame_pieces("bucket", {"index": count}, {"big": torch.ones(3 << 18)})))  # 3 MiB: mmap
    return frames


def chunked(data: bytes, rng: random.Random, trailers: bytes = b"") -> bytes:
    out, at = [], 0
    while at < len(data):
        size = rng.choice([1, 2, 3, 7, 8, 9, 100, 4096, 70_000, 1 << 20])
        piece = data[at : at + size]
        extension = rng.choice([b"", b";name", b';name="a value"', b"; a=b"])
        out.append(b"%x%s\r\n%s\r\n" % (len(piece), extension, piece))
        at += size
    return b"".join(out) + b"0;last=1\r\n" + trailers + b"\r\n"


def read(reader: ChunkedFrameReader, wire: bytes, rng: random.Random) -> list:
    """Drives `reader` as the protocol does: socket reads into its buffers, of whatever size the
    kernel has, and now and then bytes read elsewhere (`feed`)."""
    frames, at = [], 0
    while at < len(wire) and not reader.done:
        if rng.random() < 0.2:
            size = rng.randint(1, 5000)
            frames += reader.feed(wire[at : at + size])
        else:
            target = reader.get_buffer()
            size = min(len(target), rng.choice([1, 5, 64, 3000, 1 << 20]), len(wire) - at)
            target[:size] = wire[at : at + size]
            frames += reader.buffer_updated(size)
        at += size
    return frames, wire[at:]


@pytest.mark.parametrize("seed", range(3))
def test_frames_come_out_whole_however_chunks_and_reads_cut_them(seed):
    rng = random.Random(seed)
    frames = frames_of(4)
    trailers = b"X-Checksum: abc\r\nX-More: 1\r\n" if seed else b""
    after = b"POST /next HTTP/1.1\r\n\r\n"
    reader = ChunkedFrameReader(FrameAssembler(8 << 20), max_data_bytes=16 << 20, max_tail_bytes=4096)
    got, unread = read(reader, chunked(b"".join(frames), rng, trailers) + after, rng)
    assert reader.done and reader.tail == b"0;last=1\r\n" + trailers + b"\r\n"
    assert bytes(reader.after) + unread == after
    assert [bytes(frame) for frame in got] == [frame[8:] for frame in frames]  # each without its length
    tensors, fields = tensors_from_buffer(got[1], "frame 1")
    assert fields == {"kind": "bucket", "index": 1} and tensors["t1.2"].shape == (3, 3)
    assert reader.data_bytes == sum(map(len, frames))


def test_discarding_drops_the_data_and_still_finds_the_end():
    rng = random.Random(5)
    reader = ChunkedFrameReader(FrameAssembler(0), max_data_bytes=1 << 30, max_tail_bytes=4096)
    reader.discarding = True
    got, unread = read(reader, chunked(b"".join(frames_of(2)), rng) + b"GET", rng)
    assert got == [] and reader.done and bytes(reader.after) + unread == b"GET"


@pytest.mark.parametrize(
    ("wire", "fault"),
    [
        (b"zz\r\nab\r\n", "does not start with a hexadecimal size"),
        (b"0x2\r\nab\r\n", "does not start with a hexadecimal size"),
        (b" 2\r\nab\r\n", "does not start with a hexadecimal size"),
        (b"2\nab\r\n", "ends in LF without CR"),
        (b"2;a\x01b\r\nab\r\n", "control characters"),
        (b"2\r\nabX\r\n", "data is followed by b'X.*', not CRLF"),
        (b"2" + b";x" * 3000 + b"\r\n", "runs past 4096 bytes"),
        (b"0\r\n" + b"X-A: b\r\n" * 1000, "trailer section runs past 4096 bytes"),
    ],
)
def test_a_broken_framing_is_refused_naming_the_fault(wire, fault):
    reader = ChunkedFrameReader(FrameAssembler(1 << 20), max_data_bytes=1 << 20, max_tail_bytes=4096)
    with pytest.raises(MalformedChunks, match=fault):
        reader.feed(wire)


def test_data_over_a_limit_is_refused_and_the_body_read_to_its_end():
    reader = ChunkedFrameReader(FrameAssembler(1 << 20), max_data_bytes=100, max_tail_bytes=4096)
    reader.feed(b"40\r\n" + b"\0" * 64 + b"\r\n")
    assert reader.refused is None
    reader.feed(b"40\r\n")  # before its data arrives
    assert isinstance(reader.refused, BodyTooLarge) and "announce 128 bytes, over 100" in str(reader.refused)
    assert reader.feed(b"\1" * 64 + b"\r\n0\r\n\r\nnext") == [] and reader.done and reader.after == b"next"
    small = ChunkedFrameReader(FrameAssembler(10), max_data_bytes=100, max_tail_bytes=4096)
    small.feed(b"9\r\n" + LENGTH.pack(11) + b"x\r\n0\r\n\r\n")  # a frame's length over the assembler's limit
    assert isinstance(small.refused, FrameTooLarge) and small.done
