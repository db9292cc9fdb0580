"""The end of every update: clip the gradient norm, take the optimizer step."""

from __future__ import annotations

import torch


def clip_and_step(
    parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_grad_norm: float
) -> float:
    """Clip the gradients of `parameters` to `max_grad_norm` (0: no clipping), step, and return the
    gradient norm measured before clipping."""
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    optimizer.step()
    return grad_norm
