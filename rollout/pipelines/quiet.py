"""Third-party noise kept away from the project's own progress bar and log lines.

diffusers and transformers draw a progress bar per component whenever a pipeline loads or saves
("Loading pipeline components", "Loading weights", "Writing model shards": dozens of lines from every
worker process and the trainer's copy), and transformers says on every process that torchvision is
missing for image processors the pipelines declare but the engine never uses. `quietly` hides those
while it runs; everything else the libraries log still shows.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

_TRANSFORMERS_IMPORTS = "transformers.utils.import_utils"


class _DropTorchvisionNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision" not in record.getMessage()


@contextlib.contextmanager
def quiet_third_party() -> Iterator[None]:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    hidden = [lib for lib in (diffusers_logging, transformers_logging) if lib.is_progress_bar_enabled()]
    for lib in hidden:
        lib.disable_progress_bar()
    notices = logging.getLogger(_TRANSFORMERS_IMPORTS)
    drop = _DropTorchvisionNotice()
    notices.addFilter(drop)
    try:
        yield
    finally:
        notices.removeFilter(drop)
        for lib in hidden:
            lib.enable_progress_bar()


def quietly(function: Callable) -> Callable:
    """`function`, run inside `quiet_third_party()`."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with quiet_third_party():
            return function(*args, **kwargs)

    return wrapper
