"""The knobs of a GRPO update (`trainers_adapters.grpo.trainer.grpo_step`; a recipe's `grpo` section).

Plain data, importing no torch: a recipe checks its config with it before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.samplers import RATIO_TOLERANCE
from rollout.settings import Rule, setting, setting_problems

# How an update weighs samples an older policy made (`trainers_adapters.grpo.off_policy`, which imports torch).
OFF_POLICY_CORRECTIONS = ("none", "tis", "rejection")

# The KL to the reference policy that `kl_beta` weighs (`trainers_adapters.grpo.loss.kl_to_reference`).
KL_FORMS = ("flow_grpo", "gaussian")


@dataclass(kw_only=True)
class GRPOSettings:
    """The knobs of `grpo_step` (a recipe's `grpo` section); each field's help is its `setting`."""

    clip_range: float = setting(1e-4, "PPO clip range of the policy ratio (Flow-GRPO: 1e-4)", above=0)
    adv_clip_max: float = setting(5.0, "advantages are clipped to [-adv_clip_max, adv_clip_max]", above=0)
    global_std: bool = setting(
        False, "normalise advantages by the std of all rewards of the step, not the group's (Flow-GRPO's global_std)"
    )
    kl_beta: float = setting(
        0.0,
        "weight of the KL to the reference policy (the base, LoRA off); 0 skips the reference forward pass",
        at_least=0,
    )
    kl_form: str = setting(
        "flow_grpo",
        "the KL kl_beta weighs (trainers_adapters.grpo.loss.KL_FORMS): flow_grpo divides by the step's std_dev_t^2 as "
        "Flow-GRPO's code does (for flow_sde the exact KL times |dt|), so a Flow-GRPO beta means what it means "
        "there; gaussian is the exact KL of the Gaussian transitions",
        one_of=KL_FORMS,
    )
    timestep_fraction: float = setting(
        1.0, "share of each trajectory's SDE steps trained on, drawn at random per sample", above=0, at_most=1
    )
    # BranchGRPO's pruning (Li et al., arXiv 2509.06040): what the loss skips; sampling and rewards
    # are unchanged.
    prune_steps: tuple[int, ...] = setting(
        (),
        "denoising steps never trained on (BranchGRPO's depth pruning)",
        rule=Rule(lambda steps: all(step >= 0 for step in steps), "step indices >= 0"),
    )
    width_ratio: float = setting(
        1.0,
        "share of the leaves whose own steps (after the last branch step; every step without branching) are "
        "trained on: the best and the worst half each by advantage, over the whole rollout (BranchGRPO's width "
        "pruning, mode 2); 1 keeps every leaf",
        above=0,
        at_most=1,
    )
    optimizer_steps: int = setting(
        1, "optimizer steps per rollout: the transitions split into this many minibatches", at_least=1
    )
    micro_batch_size: int = setting(
        16, "transitions per forward/backward pass (a memory knob; the result is the same)", at_least=1
    )
    off_policy_correction: str = setting(
        "none",
        "how samples of an older policy (asynchronous training) are weighed, per denoising step, with w = "
        "exp(proximal - behaviour log-prob): none (PPO's ratio against the behaviour log-probs, as on-policy), "
        "tis (decoupled PPO ratio against the policy at the update's start, times min(w, importance_cap)), "
        "rejection (the same ratio; steps with w outside [1/importance_cap, importance_cap] left out); "
        "formulas in docs/training.md",
        one_of=OFF_POLICY_CORRECTIONS,
    )
    importance_cap: float = setting(
        2.0, "C of off_policy_correction tis and rejection (verl's rollout_is_threshold default: 2)", above=1
    )
    max_grad_norm: float = setting(
        1.0, "gradient-norm clip per optimizer step; 0 disables it", at_least=0, why="0 disables clipping"
    )
    # The default is the re-scoring contract: float32 re-scoring gives under 1e-6, but bfloat16 with
    # batches split over ranks reaches about 4e-5, so a bfloat16 run sets a looser bound (the shipped
    # bfloat16 configs take 1e-4).
    max_log_ratio_before_update: float | None = setting(
        RATIO_TOLERANCE,
        "above this max |log ratio| before the first optimizer step (each transition re-scored by the adapter that "
        "sampled it: the policy, or an asynchronous run's older adapter) the update raises PolicyDriftError instead "
        "of training on transitions that adapter did not sample; None only reports it",
        above=0,
        or_none=True,
    )

    def __post_init__(self) -> None:
        problems = setting_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
