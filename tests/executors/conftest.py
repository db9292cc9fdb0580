"""Fixtures for executor tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def trainer_adapters(tiny_models):
    """A single-device adapter of a tiny family's pipeline, loaded once per module: the trainer's
    copy that re-scores a group's trajectories."""
    from rollout.pipelines.loading import load_adapter

    cache: dict = {}

    def adapter(name: str):
        if name not in cache:
            cache[name] = load_adapter(tiny_models(name))
        return cache[name]

    return adapter
