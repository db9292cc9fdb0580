"""What the image-to-video tests share: the frame counts the workers encode a first frame for, and
the refusal of a request with no first frame or with two."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def counted_encodings(engine) -> Iterator[list]:
    """While the block runs, each call of the workers' `encode_images` (an in-process engine's)
    appends the frame count it encoded for to the list this yields."""
    calls = []

    def count(worker):
        adapter = worker.adapter

        def counted(images, _encode=adapter.encode_images):
            calls.append(images.setting("num_frames", None))
            return _encode(images)

        adapter.encode_images = counted  # an instance attribute: shadows the class's method

    engine.collective_rpc(count)
    try:
        yield calls
    finally:
        engine.collective_rpc(lambda worker: vars(worker.adapter).pop("encode_images"))


def assert_one_first_frame_is_required(engine, params, frame) -> None:
    """A request with no input image, and one with two, are refused at admission, the rule named."""
    with pytest.raises(ValueError, match=r"makes a video from its first frame: pass images=\[\[image\], \.\.\.\]"):
        engine.generate("x", params)
    with pytest.raises(ValueError, match="takes at most 1 input images per prompt, got 2"):
        engine.generate("x", params, images=[[frame, frame]])
