"""New weights in a file, for the tests of a user's own weight sync (`@stages_weights` worker
functions that read it on every rank), in process and over HTTP alike."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from safetensors.torch import save_file


@contextlib.contextmanager
def new_weights_file(front, state: dict, changed: dict, folder: Path) -> Iterator[tuple[str, dict]]:
    """`changed` (new values for some of the weights in `state`) saved as a safetensors file in
    `folder`: yields its path and the whole state they make, then puts `front`'s weights (an
    engine's or a server's) back to `state`, at the version they had."""
    path = folder / "new.safetensors"
    save_file(changed, path)
    version = front.weight_version
    yield str(path), state | changed
    front.update_weights(state, version=version)
