"""The end of every update: check the loss and the gradient are finite, clip the gradient norm,
take the optimizer step.

A NaN or an infinity anywhere in a loss reaches every trained parameter through one optimizer
step, and from there every sample the engine draws after the next push. So a trainer step refuses
to step on one, before anything changes.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


class NonFiniteUpdateError(RuntimeError):
    """A training step's loss or gradient is NaN or infinite; the optimizer did not step and the
    parameters are unchanged."""


def check_finite_loss(value: float, optimizer: torch.optim.Optimizer, what: str) -> None:
    """Raise `NonFiniteUpdateError` (gradients cleared) if `value`, a loss, is not finite."""
    if math.isfinite(value):
        return
    optimizer.zero_grad(set_to_none=True)
    raise NonFiniteUpdateError(
        f"the loss of {what} is {value}; the optimizer did not step and the parameters are unchanged. "
        "Common causes: a reward that returned NaN, scoring a step without a log-density "
        "(see trajectory.scorable_steps), or a learning rate that made the policy diverge"
    )


def clip_and_step(
    parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_grad_norm: float
) -> float:
    """Clip the gradients of `parameters` to `max_grad_norm` (0: no clipping), step, and return the
    gradient norm measured before clipping. A non-finite norm raises `NonFiniteUpdateError` first
    (gradients cleared, no step)."""
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # FSDP's: over every rank's shards
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteUpdateError(
            f"the gradient norm is {grad_norm} before the optimizer step; it did not step and the parameters "
            "are unchanged (a loss term that is finite can still have an infinite gradient, e.g. a std near 0)"
        )
    optimizer.step()
    return grad_norm
