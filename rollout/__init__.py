"""diffusion-rollout: an RL rollout engine for diffusion policies.

The public names, in one table: the three fronts a trainer drives (in process, asyncio, over HTTP),
the API they conform to, the configuration and parameters a request takes, what it returns, and
the errors it raises. Each is imported from its module on first use (PEP 562): `import rollout`
costs nothing, and `from rollout import EngineConfig` brings neither torch nor the engine, the
executors or the server (a recipe's config check runs without them). Importing the engine here
would also make every `import executors` depend on itself: the executors import rollout's modules.
The same names are imported under `TYPE_CHECKING` (never at run time) so that IDEs and type
checkers see through the table; tests/test_api.py holds the two equal.
"""

from __future__ import annotations

from rollout.imports import lazy_public_names

# What IDEs and type checkers read: the table below as imports (never run; `X as X` marks a
# re-export). mypy and pyright take any name TYPE_CHECKING as true, and the annotation keeps Jedi
# from reading the block as dead; `typing.TYPE_CHECKING` would cost `import rollout` the import of
# `typing` (about 3 ms, more than the rest of it).
TYPE_CHECKING: bool = False
if TYPE_CHECKING:
    from rollout.api import AsyncRolloutAPI as AsyncRolloutAPI
    from rollout.api import RolloutAPI as RolloutAPI
    from rollout.config import EngineConfig as EngineConfig
    from rollout.engine.async_engine import AsyncRolloutEngine as AsyncRolloutEngine
    from rollout.engine.rollout_engine import RolloutEngine as RolloutEngine
    from rollout.errors import EngineDeadError as EngineDeadError
    from rollout.errors import RequestFailedError as RequestFailedError
    from rollout.errors import WorkerError as WorkerError
    from rollout.model_spec import ModelSpec as ModelSpec
    from rollout.node_id import NodeId as NodeId
    from rollout.outputs import RolloutOutput as RolloutOutput
    from rollout.outputs import Trajectory as Trajectory
    from rollout.sampling_params import SamplingParams as SamplingParams
    from rollout.serve.client import RemoteRolloutEngine as RemoteRolloutEngine
    from rollout.step_series import StepSeries as StepSeries

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
    "ModelSpec": "rollout.model_spec",
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

__all__, __getattr__, __dir__ = lazy_public_names(__name__, PUBLIC_NAMES, globals())
