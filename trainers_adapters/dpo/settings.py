"""The knobs of a Diffusion-DPO update (`trainers_adapters.dpo.trainer.dpo_step`; a recipe's `dpo` section).

Plain data, importing no torch: a recipe checks its config with it before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.settings import setting, setting_problems


@dataclass(kw_only=True)
class DPOSettings:
    """The knobs of `dpo_step` (a recipe's `dpo` section); each field's help is its `setting`."""

    beta: float = setting(
        2000.0, "preference strength of the DPO loss (Diffusion-DPO: 2000-5000 on mean errors)", above=0
    )
    micro_batch_size: int = setting(8, "preference pairs per forward/backward pass", at_least=1)
    max_grad_norm: float = setting(1.0, "gradient-norm clip; 0 disables it", at_least=0, why="0 disables clipping")

    def __post_init__(self) -> None:
        problems = setting_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
