"""The trainer's side of `RolloutEngine.weights_checksum`: the same digest of its own copy."""

from __future__ import annotations

from torch import nn

from rollout.weights.state import base_state, checksum


def weights_checksum(module: nn.Module) -> str:
    """SHA-256 of the module's weights, as the engine computes it (LoRA layers are not weights)."""
    return checksum(base_state(module))
