"""GRPO training (Flow-GRPO style) of a LoRA policy with rollouts from the engine.

    python -m recipes.run recipes/configs/grpo_tiny.yaml

See `recipes.training` for the loop and the files a run writes, and
`trainers_adapters.grpo_trainer` for the update.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.config import option
from recipes.training_config import TrainingConfig
from trainers_adapters.grpo_settings import GRPOSettings


@dataclass(kw_only=True)
class Config(TrainingConfig):
    grpo: GRPOSettings = option(factory=GRPOSettings)
    output_dir: str = option("outputs/grpo", "folder for metrics, plots, sample grids and the final LoRA")

    @classmethod
    def value_problems(cls, values: dict) -> list[str]:
        problems = super().value_problems(values)
        sampling = values.get("sampling")
        if sampling is not None and sampling.sampler == "ode":
            problems.append("sampling.sampler 'ode' has no log-probs for GRPO; use flow_sde, cps or dance_sde")
        elif sampling is not None and not any(sampling.sde_mask()):
            problems.append(f"sampling.sde_window {sampling.sde_window} holds no step; GRPO trains on the SDE steps")
        return problems


def run(config: Config) -> dict:
    # The loop and the update import torch: imported when the recipe runs, so that its config is
    # checked without them.
    from recipes.training import train
    from trainers_adapters.grpo_trainer import grpo_step

    def update(policy, optimizer, rollout, generator):
        return grpo_step(policy, optimizer, rollout, config.grpo, generator)

    def postfix(stats) -> dict:
        ratio = stats.log_ratio_before_update  # None: every sample of the step was stale
        return {"log_ratio0": "stale" if ratio is None else f"{ratio:.1e}"}

    return train(config, update, postfix)
