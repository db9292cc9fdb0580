"""Shared fixtures: one tiny SD3 pipeline per test session, built with the real classes."""

from __future__ import annotations

import pytest

from rollout.pipelines.tiny import build_tiny_sd3


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of a tiny StableDiffusion3Pipeline saved with save_pretrained (random weights)."""
    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "pipeline", seed=0))


@pytest.fixture(scope="module")
def engine(tiny_model):
    """An in-process engine on the tiny model, shared by the tests of one module."""
    from rollout import EngineConfig, RolloutEngine

    with RolloutEngine(EngineConfig(model=tiny_model, max_batch_size=16)) as engine:
        yield engine


@pytest.fixture(scope="module")
def trainer_adapter(tiny_model):
    """A separate copy of the model, as a trainer would hold it, for re-scoring."""
    from rollout.pipelines.loading import load_adapter

    return load_adapter(tiny_model)
