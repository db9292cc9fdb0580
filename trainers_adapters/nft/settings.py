"""The knobs of a DiffusionNFT update (`trainers_adapters.nft.trainer.nft_step`; a recipe's `nft` section).

Plain data, importing no torch: a recipe checks its config with it before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout.settings import setting, setting_problems

if TYPE_CHECKING:
    from trainers_adapters.policy.old_policy import DecaySchedule


@dataclass(kw_only=True)
class NFTSettings:
    """The knobs of `nft_step` (a recipe's `nft` section); each field's help is its `setting`."""

    beta: float = setting(
        1.0,
        "how far the implicit policies v+ = beta v + (1 - beta) v_old and v- = (1 + beta) v_old - beta v reach "
        "from the old policy (DiffusionNFT's config.beta: 1.0; 0.1 for OCR and multi-reward)",
        above=0,
        at_most=1,
    )
    adv_clip_max: float = setting(
        5.0, "advantages are clipped to +-adv_clip_max and mapped to r in [0, 1]; the loss is scaled by it", above=0
    )
    global_std: bool = setting(
        True, "normalise advantages by the std of all rewards of the step, not the group's (DiffusionNFT: true)"
    )
    kl_beta: float = setting(
        0.0,
        "weight of mean((v - v_ref)^2), the velocity's distance to the reference (the base, LoRA off); "
        "DiffusionNFT's train.beta 1e-4; 0 skips the reference forward pass",
        at_least=0,
    )
    timestep_fraction: float = setting(
        0.99,
        "share of each sample's schedule noise levels trained on, int(steps * fraction) of them (at least 1)",
        above=0,
        at_most=1,
    )
    old_decay_flat_steps: int = setting(
        0, "optimizer steps during which the old policy copies the current one", at_least=0
    )
    old_decay_rate: float = setting(
        0.001, "the old policy's EMA decay grows by this per optimizer step after those", at_least=0
    )
    old_decay_max: float = setting(
        0.5,
        "the cap of the old policy's EMA decay (DiffusionNFT's decay_type 1: 0.5)",
        at_least=0,
        below=1,
        why="1 freezes the old policy",
    )
    optimizer_steps: int = setting(
        1, "optimizer steps per rollout: the samples split into this many minibatches", at_least=1
    )
    micro_batch_size: int = setting(
        16, "(sample, noise level) pairs per forward/backward pass (a memory knob)", at_least=1
    )
    max_grad_norm: float = setting(
        1.0, "gradient-norm clip per optimizer step; 0 disables it", at_least=0, why="0 disables clipping"
    )

    def __post_init__(self) -> None:
        problems = setting_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    def decay_schedule(self) -> DecaySchedule:
        from trainers_adapters.policy.old_policy import DecaySchedule  # torch, imported when training

        return DecaySchedule(self.old_decay_flat_steps, self.old_decay_rate, self.old_decay_max)
