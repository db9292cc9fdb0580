"""diffusion-rollout: an RL rollout engine for diffusion policies.

The public names, in one table: the three fronts a trainer drives (in process, asyncio, over HTTP),
the API they conform to, the configuration and parameters a request takes, what it returns, and
the errors it raises. Each is imported from its module on first use (PEP 562): `import rollout`
costs nothing, and `from rollout import EngineConfig` brings neither torch nor the engine, the
executors or the server (a recipe's config check runs without them). Importing the engine here
would also make every `import executors` depend on itself: the executors import rollout's modules.
"""

from __future__ import annotations

import importlib

PUBLIC_NAMES = {
    # The fronts (rollout.api declares what they share).
    "RolloutEngine": "rollout.engine.rollout_engine",
    "AsyncRolloutEngine": "rollout.engine.async_engine",
    "RemoteRolloutEngine": "rollout.serve.client",
    "RolloutAPI": "rollout.api",
    "AsyncRolloutAPI": "rollout.api",
    # What a request and an engine are made of.
    "EngineConfig": "rollout.config",
    "SamplingParams": "rollout.sampling_params",
    "ModelSpec": "rollout.pipelines.spec",
    "NodeId": "rollout.node_id",
    # What comes back.
    "RolloutOutput": "rollout.outputs",
    "Trajectory": "rollout.outputs",
    "StepSeries": "rollout.step_series",
    # What can go wrong.
    "EngineDeadError": "rollout.errors",
    "RequestFailedError": "rollout.errors",
    "WorkerError": "rollout.errors",
}

__all__ = sorted(PUBLIC_NAMES)


def __getattr__(name: str):
    module = PUBLIC_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup finds it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC_NAMES))
