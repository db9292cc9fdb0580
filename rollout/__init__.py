"""diffusion-rollout: an RL rollout engine for diffusion policies."""

from rollout.config import EngineConfig
from rollout.node_id import NodeId
from rollout.outputs import RolloutOutput, Trajectory
from rollout.sampling_params import SamplingParams

__all__ = ["EngineConfig", "NodeId", "RolloutEngine", "RolloutOutput", "SamplingParams", "Trajectory"]


def __getattr__(name: str):
    # The engine is imported on first use (PEP 562), not with the package: it imports the executors,
    # whose modules import rollout's own (and so run this file); importing it here would make every
    # `import executors` depend on itself.
    if name == "RolloutEngine":
        from rollout.engine import RolloutEngine

        return RolloutEngine
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
