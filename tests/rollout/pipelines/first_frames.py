"""What the image-to-video tests share: the frame counts the workers encode a first frame for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


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
