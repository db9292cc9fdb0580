"""The log of a recipe's run, as each of its processes sets it up (`python -m recipes.run`, a
torchrun rank, a Ray rank actor): rank 0 speaks for the run; the other ranks only warn."""

from __future__ import annotations

import logging


def configure_logging(is_main: bool) -> None:
    """INFO lines from rank 0 (`is_main`), warnings and errors only from the other ranks."""
    level = logging.INFO if is_main else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per HTTP call with engine.url
