"""Coefficients-preserving sampling (CPS): the DDIM-style stochastic step for flow matching, which
keeps the signal and noise coefficients of x' consistent with the schedule.

std_t = sigma_next * sin(a * pi / 2); x0 = x - sigma * v; x1 = x + (1 - sigma) * v
mean  = (1 - sigma_next) * x0 + sqrt(sigma_next^2 - std_t^2) * x1;  x' = mean + std_t * eps

The log-prob depends on `log_prob_form`: "gaussian" is the density of N(mean, std_t^2);
"flow_grpo" is what Flow-GRPO's code computes for CPS, -(x' - mean)^2 with every constant and the
1 / (2 std_t^2) factor dropped. Log-ratios of the two differ by that factor: a clip range tuned in
one form means something else in the other. `std_dev_t` is std_t (CPS has no sqrt(dt) factor).
At sigma_next = 0 the std is 0 and the step is the ODE's (x0), so the last step of a schedule is
never stochastic under CPS.
"""

from __future__ import annotations

import math

import torch

from rollout.samplers.step_output import stochastic_step


def _cps(x, v, sigma, sigma_next, noise_level):
    std_t = sigma_next * torch.sin(noise_level * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + torch.sqrt(sigma_next**2 - std_t**2) * x1
    return mean, std_t, std_t


step = stochastic_step(_cps, flow_grpo_drops_constants=True)
