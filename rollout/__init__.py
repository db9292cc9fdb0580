"""diffusion-rollout: an RL rollout engine for diffusion policies."""

from rollout.config import EngineConfig
from rollout.engine import RolloutEngine
from rollout.outputs import RolloutOutput, Trajectory
from rollout.sampling_params import SamplingParams

__all__ = ["EngineConfig", "RolloutEngine", "RolloutOutput", "SamplingParams", "Trajectory"]
