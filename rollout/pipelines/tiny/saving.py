"""Saving a freshly built tiny pipeline, the same way for every family."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def save(pipeline, path: Path, dtype: torch.dtype) -> Path:
    """Save `pipeline` (built in float32) to `path` in `dtype`; returns `path`."""
    if dtype != torch.float32:  # diffusers warns when a float32 pipeline is cast to float32
        pipeline.to(dtype=dtype)
    pipeline.save_pretrained(path)
    logger.info("saved a tiny %s to %s", type(pipeline).__name__, path)
    return path
