"""Flow-GRPO's SDE step (Liu et al., "Flow-GRPO", arXiv 2505.05470), the reverse-time SDE whose
marginals match the flow ODE, discretised with Euler-Maruyama.

std_t = a * sqrt(sigma / (1 - sigma)); at sigma = 1 the denominator uses the schedule's next sigma
(the published rule uses sigmas[1], which is sigma_next for the only step that starts at sigma = 1).
mean = x * (1 + std_t^2 * dt / (2 sigma)) + v * (1 + std_t^2 * (1 - sigma) / (2 sigma)) * dt
x'   = mean + std_t * sqrt(-dt) * eps

The log-prob is the Gaussian density in both `log_prob_form`s: Flow-GRPO's code computes the
density for this rule. `std_dev_t` is std_t, the diffusion coefficient (what Flow-GRPO's KL divides by).
"""

from __future__ import annotations

import torch

from rollout.samplers.step_output import stochastic_step


def _flow_sde(x, v, sigma, sigma_next, a):
    dt = sigma_next - sigma
    std_t = a * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_next, sigma)))
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_t * torch.sqrt(-dt), std_t


step = stochastic_step(_flow_sde)
