"""The wire format round trip: outputs encoded into frames and decoded back are bitwise the same,
however the byte stream is cut; anything malformed is a WireError, never an arbitrary import."""

from __future__ import annotations

import json

import pytest
import torch

from rollout import SamplingParams
from rollout.http.wire import (
    FrameReader,
    OutputDecoder,
    OutputEncoder,
    WireError,
    frame,
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
    for name in ("os.system", "builtins.eval", "rollout.pipelines.families.sd3.adapter.SD3Adapter"):
        [(fields, tensors)] = FrameReader().feed(frame("embeds", {"key": "e0", "class": name}))
        with pytest.raises(WireError):
            decoder.decode(fields, tensors)


def test_a_stream_cut_inside_a_frame_is_an_error():
    reader = FrameReader()
    assert list(reader.feed(frame("requests", {"request_ids": ["a"]})[:-3])) == []
    with pytest.raises(WireError, match="ended inside a frame"):
        reader.close()


def test_input_images_round_trip_and_misnamed_tensors_are_refused():
    from rollout.http.wire import WireError, decode_images, image_sizes, images_to_tensors, named_images
    from rollout.input_images import images_per_prompt

    first, second = torch.zeros(3, 4, 8, dtype=torch.uint8), torch.full((3, 8, 4), 7, dtype=torch.uint8)
    tensors = images_to_tensors(images_per_prompt([[first], None, [second]], 3))
    assert sorted(tensors) == ["images.0.0", "images.2.0"]
    named = named_images(tensors, 3)
    assert image_sizes(named) == [[(4, 8)], [], [(8, 4)]]
    back = decode_images(named)
    assert back[1] is None and torch.equal(back[0][0], first) and torch.equal(back[2][0], second)
    with pytest.raises(WireError, match="'weights' of a generate body is not an image"):
        named_images({"weights": first}, 1)
    with pytest.raises(WireError, match="is for prompt 3, but the body has 3 prompts"):
        named_images({"images.3.0": first}, 3)
    with pytest.raises(WireError, match="numbered \\[1\\]; number them from 0"):
        named_images({"images.0.1": first}, 1)
    with pytest.raises(WireError, match="is not a PNG file"):
        image_sizes(named_images({"images.0.0.png": torch.zeros(10, dtype=torch.uint8)}, 1))


def test_a_png_is_sized_from_its_header_without_decoding_it():
    """A 17 KB PNG of a 12000 x 12000 image decodes to 2 GB: its size comes from its header (the
    server checks it, and holds its share of the server's image budget, before it decodes)."""
    import io
    import time

    from PIL import Image

    from rollout.http.wire import image_sizes, named_images

    png = io.BytesIO()
    Image.new("1", (12000, 9000)).save(png, format="PNG")  # 1-bit: a few KB for 108 MB of pixels
    assert len(png.getvalue()) < 50_000
    tensors = {"images.0.0.png": torch.frombuffer(bytearray(png.getvalue()), dtype=torch.uint8)}
    start = time.perf_counter()
    assert image_sizes(named_images(tensors, 1)) == [[(9000, 12000)]]
    assert time.perf_counter() - start < 0.1  # a decode takes seconds


def test_a_png_whose_image_data_ends_before_its_rows_is_refused():
    """A PNG whose IHDR says 64 x 64, with a whole zlib stream of 8 rows, was taken: PIL read its 56
    missing rows as zeros (a cut-off file is refused). Every form PIL writes still decodes as PIL
    decodes it: colour types, bit depths, palettes, interlaced."""
    import io

    import numpy as np
    from PIL import Image

    from benchmarks.serve_probes import png_of_zeros
    from rollout.http.tensor_bytes import png_image

    def tensor(data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    for colour in (False, True):
        with pytest.raises(WireError, match=r"'x' is not a whole PNG file: .* needs \d+: rows are missing"):
            png_image(tensor(png_of_zeros(64, 64, colour=colour, rows=8)), "x")
        with pytest.raises(WireError, match="rows are missing"):
            png_image(tensor(png_of_zeros(64, 64, colour=colour, rows=63)), "x")
        assert torch.equal(png_image(tensor(png_of_zeros(64, 64, colour=colour)), "x"), torch.zeros(3, 64, 64).byte())
    pixels = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    for mode in ("RGB", "RGBA", "L", "LA", "P", "1", "I;16"):
        for interlace in (0, 1):
            written = io.BytesIO()
            Image.fromarray(pixels).convert(mode).save(written, format="PNG", interlace=interlace)
            expected = np.asarray(Image.open(io.BytesIO(written.getvalue())).convert("RGB"))
            got = png_image(tensor(written.getvalue()), "x")
            assert torch.equal(got, torch.from_numpy(expected.copy()).permute(2, 0, 1)), (mode, interlace)
