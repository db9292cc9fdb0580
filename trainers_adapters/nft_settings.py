"""The knobs of a DiffusionNFT update (`trainers_adapters.nft_trainer.nft_step`; a recipe's `nft` section).

Plain data, importing no torch: a recipe checks its config with it before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout.settings import setting

if TYPE_CHECKING:
    from trainers_adapters.old_policy import DecaySchedule


@dataclass(kw_only=True)
class NFTSettings:
    """The knobs of `nft_step` (a recipe's `nft` section); each field's help is its `setting`."""

    beta: float = setting(
        1.0,
        "how far the implicit policies v+ = beta v + (1 - beta) v_old and v- = (1 + beta) v_old - beta v reach "
        "from the old policy (DiffusionNFT's config.beta: 1.0; 0.1 for OCR and multi-reward)",
    )
    adv_clip_max: float = setting(
        5.0, "advantages are clipped to +-adv_clip_max and mapped to r in [0, 1]; the loss is scaled by it"
    )
    global_std: bool = setting(
        True, "normalise advantages by the std of all rewards of the step, not the group's (DiffusionNFT: true)"
    )
    kl_beta: float = setting(
        0.0,
        "weight of mean((v - v_ref)^2), the velocity's distance to the reference (the base, LoRA off); "
        "DiffusionNFT's train.beta 1e-4; 0 skips the reference forward pass",
    )
    timestep_fraction: float = setting(
        0.99, "share of each sample's schedule noise levels trained on, int(steps * fraction) of them (at least 1)"
    )
    old_decay_flat_steps: int = setting(0, "optimizer steps during which the old policy copies the current one")
    old_decay_rate: float = setting(0.001, "the old policy's EMA decay grows by this per optimizer step after those")
    old_decay_max: float = setting(0.5, "the cap of the old policy's EMA decay (DiffusionNFT's decay_type 1: 0.5)")
    optimizer_steps: int = setting(1, "optimizer steps per rollout: the samples split into this many minibatches")
    micro_batch_size: int = setting(16, "(sample, noise level) pairs per forward/backward pass (a memory knob)")
    max_grad_norm: float = setting(1.0, "gradient-norm clip per optimizer step; 0 disables it")

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.beta <= 1:
            problems.append(f"beta must be in (0, 1], got {self.beta}")
        if self.adv_clip_max <= 0:
            problems.append(f"adv_clip_max must be > 0, got {self.adv_clip_max}")
        if self.kl_beta < 0:
            problems.append(f"kl_beta must be >= 0, got {self.kl_beta}")
        if not 0 < self.timestep_fraction <= 1:
            problems.append(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.old_decay_flat_steps < 0:
            problems.append(f"old_decay_flat_steps must be >= 0, got {self.old_decay_flat_steps}")
        if self.old_decay_rate < 0:
            problems.append(f"old_decay_rate must be >= 0, got {self.old_decay_rate}")
        if not 0 <= self.old_decay_max < 1:
            problems.append(f"old_decay_max must be in [0, 1) (1 freezes the old policy), got {self.old_decay_max}")
        if self.optimizer_steps < 1:
            problems.append(f"optimizer_steps must be >= 1, got {self.optimizer_steps}")
        if self.micro_batch_size < 1:
            problems.append(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_grad_norm < 0:
            problems.append(f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if problems:
            raise ValueError("; ".join(problems))

    def decay_schedule(self) -> DecaySchedule:
        from trainers_adapters.old_policy import DecaySchedule  # torch, imported when training

        return DecaySchedule(self.old_decay_flat_steps, self.old_decay_rate, self.old_decay_max)
