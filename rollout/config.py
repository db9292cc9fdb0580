"""Engine configuration, checked when it is made so a bad setting fails before any model loads."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

import torch

from rollout.pipelines.loading import read_model_index
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
        problems = []
        try:
            read_model_index(self.model)
        except ValueError as error:
            problems.append(str(error))
        problems += self._settings_problems()
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

    @classmethod
    def problems_without_model(cls, **settings) -> list[str]:
        """What `EngineConfig(model=..., **settings)` would find wrong apart from the model folder,
        for configs checked before their model exists (a recipe builds `tiny` only when it runs)."""
        unchecked = object.__new__(cls)  # skips __post_init__, which reads the model folder
        defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
        unchecked.__dict__.update(defaults | settings)
        return unchecked._settings_problems()

    @classmethod
    def described(cls, settings: dict) -> EngineConfig:
        """A config as a rollout server reports it, unchecked: its model folder and classes are on
        the server's machine, not necessarily on this one."""
        config = object.__new__(cls)  # skips __post_init__
        config.__dict__.update(settings)
        return config

    def _settings_problems(self) -> list[str]:
        problems = self._class_problems()
        if self.dtype not in _DTYPES:
            problems.append(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            problems.append(f"num_workers must be an integer >= 1, got {self.num_workers!r}")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            problems.append(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if self.threads_per_worker is not None and (
            not isinstance(self.threads_per_worker, int) or self.threads_per_worker < 1
        ):
            problems.append(f"threads_per_worker must be an integer >= 1 or None, got {self.threads_per_worker!r}")
        for name in ("rpc_timeout_s", "step_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            problems.append(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        return problems

    def _class_problems(self) -> list[str]:
        """Resolve the executor and worker extension now, so a typo fails before any model loads;
        a resolved executor adds its own rules (`Executor.config_problems`)."""
        from executors import get_executor_class
        from rollout.worker import build_worker_class

        problems = []
        for resolve, value in ((get_executor_class, self.executor), (build_worker_class, self.worker_extension_cls)):
            try:
                resolved = resolve(value)
            except (ValueError, TypeError) as error:
                problems.append(str(error))
            else:
                if resolve is get_executor_class:
                    problems += resolved.config_problems(self)
        return problems

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
