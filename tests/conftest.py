"""Shared fixtures: one tiny pipeline per family and test session, built with the real classes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.families import ALL_FAMILIES


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Callable[[str], str]:
    """`tiny_models(family)`: the path of that family's tiny pipeline (see tests/families.py),
    saved with save_pretrained (random weights) the first time it is asked for."""
    paths: dict[str, str] = {}

    def path_of(family: str) -> str:
        if family not in paths:
            folder = tmp_path_factory.mktemp(f"tiny_{family}") / "pipeline"
            paths[family] = str(ALL_FAMILIES[family].build_tiny(folder, seed=0))
        return paths[family]

    return path_of


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> str:
    """Path of the tiny StableDiffusion3Pipeline."""
    return tiny_models("sd3")


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


@pytest.fixture(scope="session")
def ray_cluster():
    """One small local Ray cluster (4 CPUs) for the whole session; Ray executors and `--ray-ranks`
    launches attach to it. A Ray an earlier test's executor started on its own (2 CPUs here) is
    replaced: a second `ray.init` in one process is an error."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> str:
    """Path of a tiny random `CLIPModel` + `CLIPProcessor` folder (the reward models' tests)."""
    from trainers_adapters.rewards.models.tiny import build_tiny_clip

    return str(build_tiny_clip(tmp_path_factory.mktemp("tiny_clip") / "clip", seed=0))


@pytest.fixture(scope="session")
def tiny_aesthetic_head(tmp_path_factory) -> str:
    """Path of a random LAION-style aesthetic head (safetensors) over the tiny CLIP's features."""
    from trainers_adapters.rewards.models.tiny import build_tiny_aesthetic_head

    return str(build_tiny_aesthetic_head(tmp_path_factory.mktemp("aesthetic") / "head.safetensors", seed=0))
