"""The knobs of a Diffusion-DPO update (`trainers_adapters.dpo_trainer.dpo_step`; a recipe's `dpo` section).

Plain data, importing no torch: a recipe checks its config with it before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.settings import setting


@dataclass(kw_only=True)
class DPOSettings:
    """The knobs of `dpo_step` (a recipe's `dpo` section); each field's help is its `setting`."""

    beta: float = setting(2000.0, "preference strength of the DPO loss (Diffusion-DPO: 2000-5000 on mean errors)")
    micro_batch_size: int = setting(8, "preference pairs per forward/backward pass")
    max_grad_norm: float = setting(1.0, "gradient-norm clip; 0 disables it")

    def __post_init__(self) -> None:
        problems = []
        if self.beta <= 0:
            problems.append(f"beta must be > 0, got {self.beta}")
        if self.micro_batch_size < 1:
            problems.append(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_grad_norm < 0:
            problems.append(f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if problems:
            raise ValueError("; ".join(problems))
