"""DiffusionNFT's loss (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward
Process", arXiv 2509.16117), in the form the authors' code computes it (NVlabs/DiffusionNFT,
scripts/train_nft_sd3.py); our own code.

No log-probs: the samples are clean latents x0 of the old policy's ODE rollouts, each with an
optimality probability r in [0, 1] made from its advantage. At a noise level t of the sampling
schedule, x_t = (1 - t) x0 + t eps is fed to the current policy (v_theta) and to the old one
(v_old, no gradient). Their mixtures are the implicit positive and negative policies

    v+ = beta v_theta + (1 - beta) v_old        v- = (1 + beta) v_old - beta v_theta

and each predicts x0 as x_t - t v. The loss pulls v+ towards the sample where r is high and v-
where r is low, each squared error divided by its own detached mean absolute error (the paper's
adaptive weighting):

    loss = adv_clip_max / beta * [ r |x0+ - x0|^2 / w+ + (1 - r) |x0- - x0|^2 / w- ]

averaged over the latent's elements and then over samples and noise levels.
"""

from __future__ import annotations

import torch

WEIGHT_FLOOR = 1e-5  # the authors' clip of the adaptive weight (a perfect x0 prediction)


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r [N] in [0, 1]: advantages clipped to [-adv_clip_max, adv_clip_max] and mapped linearly
    (-adv_clip_max -> 0, 0 -> 1/2, adv_clip_max -> 1), as the authors' code normalises them."""
    clipped = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (clipped / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def implicit_velocities(v_theta: torch.Tensor, v_old: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(v+, v-): the implicit positive and negative policies' velocities, same shape as the inputs;
    gradients flow through v_theta only."""
    v_old = v_old.detach()
    return beta * v_theta + (1 - beta) * v_old, (1.0 + beta) * v_old - beta * v_theta


def adaptive_x0_error(x0_prediction: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per-sample [B] mean of |x0_pred - x0|^2 / w, with w the detached per-sample mean absolute
    error (computed in float64, floored at WEIGHT_FLOOR)."""
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (x0_prediction.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=WEIGHT_FLOOR)
    return ((x0_prediction - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    beta: float,
    adv_clip_max: float,
) -> torch.Tensor:
    """Per-sample DiffusionNFT policy loss [B] (see the module docstring).

    v_theta, v_old, x_t, x0: [B, *latent_shape] float32; t: [B] noise levels in (0, 1]; r: [B]
    optimality probabilities. The caller averages over samples and noise levels."""
    t = t.view(-1, *([1] * (x0.ndim - 1)))
    positive, negative = implicit_velocities(v_theta, v_old, beta)
    positive_error = adaptive_x0_error(x_t - t * positive, x0)
    negative_error = adaptive_x0_error(x_t - t * negative, x0)
    return (r * positive_error / beta + (1.0 - r) * negative_error / beta) * adv_clip_max
