"""Engine configuration, checked when it is made so a bad setting fails before any model loads."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

import torch

from rollout.pipelines.loading import read_model_index
from rollout.request_limits import RequestLimits
from rollout.settings import setting

_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """How to build a `RolloutEngine`: the model folder, where its workers run, and the bounds the
    engine puts on calls and requests. Each field's meaning, unit and choices are its `setting` help
    (`rollout.settings.setting_help`), which the server's flags and the recipes' `engine` section
    show as they are."""

    model: str = setting(help="local diffusers pipeline folder (nothing is downloaded)")
    executor: str | type = setting(
        "uni",
        "where the workers run: 'uni' (in this process), 'mp' (worker processes), 'ray' (Ray actors), or the "
        "dotted path 'pkg.module.MyExecutor' of an executors.Executor subclass (in Python also the class)",
    )
    num_workers: int = setting(1, "model replicas (data parallel); 'uni' runs exactly one")
    worker_extension_cls: str | type | None = setting(
        None,
        "dotted path (in Python also the class) of a class whose methods become worker functions, callable by "
        "name through collective_rpc (a server's /collective_rpc)",
    )
    device: str = setting("cpu", "'cpu', 'cuda' or 'cuda:N'")
    dtype: str = setting("float32", "model weights dtype: float32, bfloat16 or float16 (trajectories stay float32)")
    max_batch_size: int = setting(16, "most samples one worker denoises in one forward pass")
    threads_per_worker: int | None = setting(
        None, "torch CPU threads of each worker process ('mp', 'ray'); None divides the machine's cores among them"
    )
    rpc_timeout_s: float = setting(300.0, "default timeout of collective_rpc (a worker function), in seconds")
    step_timeout_s: float = setting(600.0, "timeout of one engine step, in seconds")
    startup_timeout_s: float = setting(600.0, "time every worker has to load the model, in seconds")
    ray_placement_strategy: str = setting(
        "PACK", "how executor 'ray' places its workers: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"
    )
    request_limits: RequestLimits = setting(
        factory=RequestLimits,
        help="what one request may ask for at most, checked at admission (see RequestLimits)",
    )

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
        elif self.executor == "uni" and self.num_workers != 1:
            problems.append(
                f"executor 'uni' runs one in-process worker, got num_workers={self.num_workers}; "
                "use executor='mp' or 'ray' for more"
            )
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            problems.append(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if self.threads_per_worker is not None and (
            not isinstance(self.threads_per_worker, int) or self.threads_per_worker < 1
        ):
            problems.append(f"threads_per_worker must be an integer >= 1 or None, got {self.threads_per_worker!r}")
        for name in ("rpc_timeout_s", "step_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.ray_placement_strategy not in _PLACEMENT_STRATEGIES:
            problems.append(
                f"ray_placement_strategy must be one of {_PLACEMENT_STRATEGIES}, got {self.ray_placement_strategy!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            problems.append(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        return problems

    def _class_problems(self) -> list[str]:
        """Resolve the executor and worker extension now, so a typo fails before any model loads."""
        from executors import get_executor_class
        from rollout.worker import build_worker_class

        problems = []
        for resolve, value in ((get_executor_class, self.executor), (build_worker_class, self.worker_extension_cls)):
            try:
                resolve(value)
            except (ValueError, TypeError) as error:
                problems.append(str(error))
        return problems

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
