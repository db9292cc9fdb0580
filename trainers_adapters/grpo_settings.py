"""The knobs of a GRPO update (`trainers_adapters.grpo_trainer.grpo_step`; a recipe's `grpo` section).

Plain data, importing no torch: a recipe checks its config with it before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.samplers import RATIO_TOLERANCE
from rollout.settings import setting

# The KL to the reference policy that `kl_beta` weighs (`trainers_adapters.grpo.kl_to_reference`).
KL_FORMS = ("flow_grpo", "gaussian")


@dataclass(kw_only=True)
class GRPOSettings:
    """The knobs of `grpo_step` (a recipe's `grpo` section); each field's help is its `setting`."""

    clip_range: float = setting(1e-4, "PPO clip range of the policy ratio (Flow-GRPO: 1e-4)")
    adv_clip_max: float = setting(5.0, "advantages are clipped to [-adv_clip_max, adv_clip_max]")
    global_std: bool = setting(
        False, "normalise advantages by the std of all rewards of the step, not the group's (Flow-GRPO's global_std)"
    )
    kl_beta: float = setting(
        0.0, "weight of the KL to the reference policy (the base, LoRA off); 0 skips the reference forward pass"
    )
    kl_form: str = setting(
        "flow_grpo",
        "the KL kl_beta weighs (trainers_adapters.grpo.KL_FORMS): flow_grpo divides by the step's std_dev_t^2 as "
        "Flow-GRPO's code does (for flow_sde the exact KL times |dt|), so a Flow-GRPO beta means what it means "
        "there; gaussian is the exact KL of the Gaussian transitions",
    )
    timestep_fraction: float = setting(
        1.0, "share of each trajectory's SDE steps trained on, drawn at random per sample"
    )
    # BranchGRPO's pruning (Li et al., arXiv 2509.06040): what the loss skips; sampling and rewards
    # are unchanged.
    prune_steps: tuple[int, ...] = setting((), "denoising steps never trained on (BranchGRPO's depth pruning)")
    width_ratio: float = setting(
        1.0,
        "share of the leaves whose own steps (after the last branch step; every step without branching) are "
        "trained on: the best and the worst half each by advantage, over the whole rollout (BranchGRPO's width "
        "pruning, mode 2); 1 keeps every leaf",
    )
    optimizer_steps: int = setting(1, "optimizer steps per rollout: the transitions split into this many minibatches")
    micro_batch_size: int = setting(
        16, "transitions per forward/backward pass (a memory knob; the result is the same)"
    )
    max_grad_norm: float = setting(1.0, "gradient-norm clip per optimizer step; 0 disables it")
    # The default is the re-scoring contract: float32 re-scoring gives under 1e-6, but bfloat16 with
    # batches split over ranks reaches about 4e-5, so a bfloat16 run sets a looser bound (the shipped
    # bfloat16 configs take 1e-4).
    max_log_ratio_before_update: float | None = setting(
        RATIO_TOLERANCE,
        "above this max |log ratio| before the first optimizer step the update raises PolicyDriftError instead "
        "of training on transitions the policy did not sample; None only reports it",
    )

    def __post_init__(self) -> None:
        problems = []
        if self.clip_range <= 0:
            problems.append(f"clip_range must be > 0, got {self.clip_range}")
        if self.adv_clip_max <= 0:
            problems.append(f"adv_clip_max must be > 0, got {self.adv_clip_max}")
        if self.kl_beta < 0:
            problems.append(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.kl_form not in KL_FORMS:
            problems.append(f"kl_form must be one of {KL_FORMS}, got {self.kl_form!r}")
        if not 0 < self.timestep_fraction <= 1:
            problems.append(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if any(step < 0 for step in self.prune_steps):
            problems.append(f"prune_steps must be step indices >= 0, got {self.prune_steps}")
        if not 0 < self.width_ratio <= 1:
            problems.append(f"width_ratio must be in (0, 1], got {self.width_ratio}")
        if self.optimizer_steps < 1:
            problems.append(f"optimizer_steps must be >= 1, got {self.optimizer_steps}")
        if self.micro_batch_size < 1:
            problems.append(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_grad_norm < 0:
            problems.append(f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if self.max_log_ratio_before_update is not None and self.max_log_ratio_before_update <= 0:
            problems.append(f"max_log_ratio_before_update must be > 0 or None, got {self.max_log_ratio_before_update}")
        if problems:
            raise ValueError("; ".join(problems))
