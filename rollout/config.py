"""Engine configuration: plain data, whose values are checked when it is made.

What needs the file system or imports (the model folder, the executor and worker extension classes,
the executor's own rules) is checked by `rollout.config_check` when an engine is built, before any
worker starts, so a typo still fails before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from rollout.request_limits import RequestLimits

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """How to build a `RolloutEngine`.

    model: a local diffusers pipeline folder.
    executor: "uni" (in-process), "mp", "ray", a dotted path "pkg.module.MyExecutor", or an
        `executors.Executor` subclass.
    num_workers: model replicas (data parallel); "uni" runs exactly one.
    worker_extension_cls: a class (or dotted path) whose methods become worker functions callable
        through `collective_rpc`.
    device: "cpu", "cuda", "cuda:1", ...
    dtype: model weights dtype, "float32" | "bfloat16" | "float16". Trajectories stay float32.
    max_batch_size: most samples one worker denoises in one forward pass.
    threads_per_worker: CPU threads of each worker process's torch ("mp", "ray"); None divides the
        machine's cores among the workers.
    rpc_timeout_s: default timeout of `collective_rpc`; step_timeout_s: of one engine step;
    startup_timeout_s: for every worker to load the model.
    ray_placement_strategy: how "ray" places its workers: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
    request_limits: what one request may ask for at most (steps, leaves, pixels, frames, prompt
        bytes, trajectory bytes), checked at admission; see `RequestLimits`.
    """

    model: str
    executor: str | type = "uni"
    num_workers: int = 1
    worker_extension_cls: str | type | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 16
    threads_per_worker: int | None = None
    rpc_timeout_s: float = 300.0
    step_timeout_s: float = 600.0
    startup_timeout_s: float = 600.0
    ray_placement_strategy: str = "PACK"
    request_limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        problems = value_problems(self)
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

    @classmethod
    def described(cls, settings: dict) -> EngineConfig:
        """A config as a rollout server reports it (`dataclasses.asdict` of its own): its model
        folder and classes are on the server's machine, and are named here by their paths."""
        known = {f.name for f in fields(cls)}
        settings = {name: value for name, value in settings.items() if name in known}
        if isinstance(settings.get("request_limits"), dict):
            settings["request_limits"] = RequestLimits(**settings["request_limits"])
        return cls(**settings)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def value_problems(config: Any) -> list[str]:
    """What is wrong with the values of `config` (an `EngineConfig`, or any object with its
    attributes), without reading files or importing classes."""
    problems = []
    if config.dtype not in _DTYPES:
        problems.append(f"dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
    if not isinstance(config.num_workers, int) or config.num_workers < 1:
        problems.append(f"num_workers must be an integer >= 1, got {config.num_workers!r}")
    if not isinstance(config.max_batch_size, int) or config.max_batch_size < 1:
        problems.append(f"max_batch_size must be an integer >= 1, got {config.max_batch_size!r}")
    if config.threads_per_worker is not None and (
        not isinstance(config.threads_per_worker, int) or config.threads_per_worker < 1
    ):
        problems.append(f"threads_per_worker must be an integer >= 1 or None, got {config.threads_per_worker!r}")
    for name in ("rpc_timeout_s", "step_timeout_s", "startup_timeout_s"):
        if getattr(config, name) <= 0:
            problems.append(f"{name} must be > 0 seconds, got {getattr(config, name)}")
    if not (config.device == "cpu" or config.device.startswith("cuda")):
        problems.append(f"device must be 'cpu' or 'cuda[:N]', got {config.device!r}")
    return problems
