"""The wire format round trip: outputs encoded into frames and decoded back are bitwise the same,
however the byte stream is cut; anything malformed is a WireError, never an arbitrary import."""

from __future__ import annotations

import json

import pytest
import torch

from rollout import SamplingParams
from rollout.wire import (
    FrameAssembler,
    FrameReader,
    FrameTooLarge,
    OutputDecoder,
    OutputEncoder,
    WireError,
    frame,
    frame_pieces,
    tensors_from_buffer,
    tensors_from_bytes,
    tensors_to_bytes,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def outputs(engine):
    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=1)
    return (
        engine.generate(["a red square", "a blue circle"], params)
        + engine.generate("no image", SamplingParams(num_inference_steps=2, seed=2, output_type="none"))
        + engine.generate("latents", SamplingParams(num_inference_steps=2, seed=2, output_type="latent"))
    )


def test_a_tree_with_records_round_trips_and_its_leaves_share_parts_again(engine):
    params = SamplingParams(
        num_inference_steps=4, seed=1, branch_steps=(1, 2), record=("x0", "std"), record_steps=(0, 1, 3)
    )
    leaves = engine.generate("a tree", params)
    encoder = OutputEncoder()
    data = b"".join(encoder.encode(output) for output in leaves)
    decoded = _decode(data, 4096)
    for got, expected in zip(decoded, leaves, strict=True):
        assert got.branch_path == expected.branch_path and got.request_id == expected.request_id
        for name, series in {"latents": expected.trajectory.latents, **expected.trajectory.records}.items():
            got_series = got.trajectory.latents if name == "latents" else got.trajectory.records[name]
            assert torch.equal(got_series.positions, series.positions) and got_series.length == series.length
            assert torch.equal(got_series.stack(), series.stack())
    parts = {id(p) for o in leaves for s in (o.trajectory.latents, *o.trajectory.records.values()) for p in s.parts}
    kinds = [fields["kind"] for fields, _ in FrameReader().feed(data)]
    assert kinds.count("part") == len(parts)  # each shared part crossed once
    assert decoded[0].trajectory.latents.parts[0] is decoded[3].trajectory.latents.parts[0]


def _decode(data: bytes, chunk: int) -> list:
    reader, decoder, decoded = FrameReader(), OutputDecoder(), []
    for start in range(0, len(data), chunk):
        for fields, tensors in reader.feed(data[start : start + chunk]):
            output = decoder.decode(fields, tensors)
            if output is not None:
                decoded.append(output)
    reader.close()
    return decoded


@pytest.mark.parametrize("chunk", [7, 4096, 1 << 30])
def test_outputs_round_trip_bitwise_however_the_stream_is_cut(outputs, chunk):
    encoder = OutputEncoder()
    data = b"".join(encoder.encode(output) for output in outputs)
    decoded = _decode(data, chunk)
    assert len(decoded) == len(outputs)
    for got, expected in zip(decoded, outputs, strict=True):
        assert (got.request_id, got.seed, got.weight_versions, got.timings) == (
            expected.request_id,
            expected.seed,
            expected.weight_versions,
            expected.timings,
        )
        assert (got.image is None) == (expected.image is None)
        if expected.image is not None:
            assert torch.equal(got.image, expected.image)
        assert (got.latents is None) == (expected.latents is None)
        if expected.latents is not None:
            assert torch.equal(got.latents, expected.latents)
        assert torch.equal(got.trajectory.latents.stack(), expected.trajectory.latents.stack())
        for name in ("log_probs", "timesteps", "sigmas", "sde_mask"):
            assert torch.equal(getattr(got.trajectory, name), getattr(expected.trajectory, name))
        for name, tensor in expected.trajectory.condition.prompt.tensors().items():
            assert torch.equal(got.trajectory.condition.prompt.tensors()[name], tensor)
    # Each text's embeddings cross once, and are shared again on arrival.
    kinds = [fields["kind"] for fields, _ in FrameReader().feed(data)]
    assert kinds.count("embeds") == 5  # four prompts and one negative prompt (""), for six outputs
    assert decoded[0].trajectory.condition.prompt is decoded[1].trajectory.condition.prompt
    assert decoded[0].trajectory.condition.negative is decoded[2].trajectory.condition.negative


def test_tensor_bodies_round_trip_with_their_metadata():
    tensors = {"w": torch.randn(3, 4, dtype=torch.bfloat16), "mask": torch.tensor([True, False])}
    data = tensors_to_bytes(tensors, {"request": json.dumps({"version": 3})})
    back, metadata = tensors_from_bytes(data)
    assert json.loads(metadata["request"]) == {"version": 3}
    assert all(torch.equal(back[name], tensor) for name, tensor in tensors.items())


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x01\x02", "shorter than its header"),
        ((1 << 40).to_bytes(8, "little") + b"{}", "runs past the end"),
        ((4).to_bytes(8, "little") + b"{no}", "not JSON"),
    ],
)
def test_malformed_safetensors_are_wire_errors(data, message):
    with pytest.raises(WireError, match=message):
        tensors_from_bytes(data, "the body")


def test_frames_cannot_name_classes_outside_the_families():
    decoder = OutputDecoder()
    for name in ("os.system", "builtins.eval", "rollout.pipelines.sd3.SD3Adapter"):
        [(fields, tensors)] = FrameReader().feed(frame("embeds", {"key": "e0", "class": name}))
        with pytest.raises(WireError):
            decoder.decode(fields, tensors)


def test_a_stream_cut_inside_a_frame_is_an_error():
    reader = FrameReader()
    assert list(reader.feed(frame("requests", {"request_ids": ["a"]})[:-3])) == []
    with pytest.raises(WireError, match="ended inside a frame"):
        reader.close()


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
