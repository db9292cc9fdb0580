"""Online Diffusion-DPO training of a LoRA policy with rollouts from the engine: each group's best
and worst sample form a preference pair.

    python -m recipes.run recipes/configs/dpo_tiny.yaml

See `recipes.training` for the loop and the files a run writes, and
`trainers_adapters.dpo_trainer` for the update.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.config import option
from recipes.training import TrainingConfig, train
from trainers_adapters.dpo_trainer import DPOSettings, DPOStepStats, dpo_step


@dataclass(kw_only=True)
class Config(TrainingConfig):
    dpo: DPOSettings = option(factory=DPOSettings)
    output_dir: str = option("outputs/dpo", "folder for metrics, plots, sample grids and the final LoRA")


def run(config: Config) -> dict:
    def update(policy, optimizer, rollout, generator) -> DPOStepStats:
        return dpo_step(policy, optimizer, rollout, config.dpo, generator)

    return train(config, update, lambda stats: {"pairs": stats.num_pairs, "acc": f"{stats.accuracy:.2f}"})
