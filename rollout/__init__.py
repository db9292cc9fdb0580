"""diffusion-rollout: an RL rollout engine for diffusion policies.

The public names, each imported from its module on first use (PEP 562): importing a submodule
runs this file, and `rollout.config` or `rollout.sampling_params` must not bring torch with them
(a recipe's config check runs without it). Importing the engine here would also make every
`import executors` depend on itself: the executors' modules import rollout's own.
"""

from __future__ import annotations

import importlib

# Public name -> the module that defines it.
PUBLIC_NAMES = {
    "EngineConfig": "rollout.config",
    "NodeId": "rollout.node_id",
    "RolloutEngine": "rollout.engine.rollout_engine",
    "RolloutOutput": "rollout.outputs",
    "SamplingParams": "rollout.sampling_params",
    "Trajectory": "rollout.outputs",
}

__all__ = sorted(PUBLIC_NAMES)


def __getattr__(name: str):
    if name in PUBLIC_NAMES:
        return getattr(importlib.import_module(PUBLIC_NAMES[name]), name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
