"""Online Diffusion-DPO training of a LoRA policy with rollouts from the engine: each group's best
and worst sample form a preference pair.

    python -m recipes.run recipes/configs/dpo_tiny.yaml

See `recipes.training` for the loop and the files a run writes, and
`trainers_adapters.dpo.trainer` for the update.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.config import option
from recipes.training_config import TrainingConfig
from trainers_adapters.dpo.settings import DPOSettings


@dataclass(kw_only=True)
class Config(TrainingConfig):
    dpo: DPOSettings = option(factory=DPOSettings)
    output_dir: str = option("outputs/dpo", "folder for metrics, plots, sample grids and the final LoRA")


def run(config: Config) -> dict:
    # The loop and the update import torch: imported when the recipe runs, so that its config is
    # checked without them.
    from recipes.training import train
    from trainers_adapters.dpo.trainer import dpo_step

    def update(policy, optimizer, rollout, generator, policy_version, behaviour, ranks):
        return dpo_step(policy, optimizer, rollout, config.dpo, generator, ranks)

    def postfix(stats) -> dict:
        return {"pairs": stats.num_pairs, "acc": f"{stats.accuracy:.2f}"}

    return train(config, update, postfix, reference=True)  # DPO's loss compares with the reference
