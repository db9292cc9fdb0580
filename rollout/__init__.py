"""diffusion-rollout: an RL rollout engine for diffusion policies."""

from rollout.config import EngineConfig
from rollout.engine import RolloutEngine
from rollout.node_id import NodeId
from rollout.outputs import RolloutOutput, Trajectory
from rollout.sampling_params import SamplingParams

__all__ = ["EngineConfig", "NodeId", "RolloutEngine", "RolloutOutput", "SamplingParams", "Trajectory"]
