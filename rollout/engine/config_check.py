"""The checks of an `EngineConfig` that need the file system or imports, in one place: the model
folder, the executor and worker extension classes, the executor's own rules
(`Executor.config_problems`), and the attention backend (what diffusers and torch offer here).
The engine runs them before any worker starts, so a typo fails before any model loads, with every
problem in one error."""

from __future__ import annotations

from types import SimpleNamespace

from executors import Executor, get_executor_class
from executors.base import transport_problems
from rollout.config import EngineConfig, settings_problems
from rollout.parallel.sequence import plan_problems
from rollout.pipelines.families import families_of
from rollout.pipelines.model_index import read_model_index
from rollout.worker.worker import build_worker_class


def check_engine_config(config: EngineConfig) -> type[Executor]:
    """The executor class `config` names; raises ValueError listing everything that would stop an
    engine from starting with it."""
    problems = []
    try:
        model_index = read_model_index(config.model)
        problems += plan_problems(model_index, config.sequence_parallel)
        problems += _dispatcher_problems(model_index["_class_name"], config.attention_backend)
    except ValueError as error:
        problems.append(str(error))
    executor_cls, class_problems = _resolve_classes(config)
    problems += class_problems + attention_problems(config)
    if problems:
        raise ValueError("invalid EngineConfig: " + "; ".join(problems))
    return executor_cls


def problems_without_model(**settings) -> list[str]:
    """What `EngineConfig(model=..., **settings)` and its classes would find wrong apart from the
    model folder, for configs checked before their model exists (a recipe builds `tiny` only when
    it runs)."""
    problems = settings_problems(**settings)
    config = SimpleNamespace(**(_defaults() | settings))
    return problems + class_problems(**settings) + ([] if problems else attention_problems(config))


def class_problems(**settings) -> list[str]:
    """What the classes that `EngineConfig(model=..., **settings)` names (the executor, the worker
    extension) and the executor's own rules find wrong; imports them, and so torch."""
    return _resolve_classes(SimpleNamespace(**(_defaults() | settings)))[1]


def _resolve_classes(config) -> tuple[type[Executor] | None, list[str]]:
    problems = []
    executor_cls = None
    try:
        executor_cls = get_executor_class(config.executor)
    except (ValueError, TypeError) as error:
        problems.append(str(error))
    try:
        build_worker_class(config.worker_extension_cls)
    except (ValueError, TypeError) as error:
        problems.append(str(error))
    if executor_cls is not None:
        problems += transport_problems(executor_cls) + executor_cls.config_problems(config)
    return executor_cls, problems


def _defaults() -> dict:
    """`EngineConfig`'s defaults, from a config made with them (`model` is not read here)."""
    return vars(EngineConfig(model=""))


def attention_problems(config) -> list[str]:
    """Why `config.attention_backend` cannot run on `config.device` in `config.dtype` with the
    installed diffusers and torch, with the choices that can (on the CPU, each is tried on one tiny
    attention; a CUDA device is not touched here: its kernels' packages and dtypes are checked)."""
    if config.attention_backend is None:
        return []
    import torch

    from rollout.pipelines.attention import backend_refusal

    refusal = backend_refusal(
        config.attention_backend, config.device, getattr(torch, config.dtype), config.sequence_parallel
    )
    return [] if refusal is None else [refusal]


def _dispatcher_problems(pipeline_class: str, backend: str | None) -> list[str]:
    """A backend named for a model whose attention does not go through diffusers' dispatcher."""
    families = families_of(pipeline_class)
    if backend is None or not families or all(family.attention_dispatcher for family in families):
        return []
    return [
        f"attention_backend {backend!r} cannot apply to {pipeline_class}: its transformer's attention calls "
        "torch's scaled_dot_product_attention itself, not diffusers' attention dispatcher; leave "
        "attention_backend None for this model"
    ]
