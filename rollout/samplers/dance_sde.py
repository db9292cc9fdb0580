"""DanceGRPO's SDE step (Xue et al., "DanceGRPO", arXiv 2505.07818): Euler-Maruyama with a constant
diffusion coefficient eta (the noise level) and the score term added to the drift.

std = eta * sqrt(sigma - sigma_next); x0 = x - sigma * v; score = -(x - (1 - sigma) * x0) / sigma^2
mean = x + dt * v - 0.5 * eta^2 * score * dt;  x' = mean + std * eps

The log-prob is the Gaussian density (DanceGRPO's), in both `log_prob_form`s: Flow-GRPO's code
writes the density for its Euler-Maruyama SDE, and "flow_grpo" applies that rule here.
`std_dev_t` is eta, the diffusion coefficient.
"""

from __future__ import annotations

import torch

from rollout.samplers.step_output import stochastic_step


def _dance_sde(x, v, sigma, sigma_next, eta):
    dt = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    mean = x + dt * v - 0.5 * eta**2 * score * dt
    return mean, eta * torch.sqrt(-dt), eta


step = stochastic_step(_dance_sde)
