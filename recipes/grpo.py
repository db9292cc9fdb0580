"""GRPO training (Flow-GRPO style) of a LoRA policy with rollouts from the engine.

    python -m recipes.run recipes/configs/grpo_tiny.yaml

See `recipes.training` for the loop and the files a run writes, and
`trainers_adapters.grpo.trainer` for the update.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.config import option
from recipes.training_config import TrainingConfig
from rollout import SamplingParams
from trainers_adapters.grpo.settings import GRPOSettings


@dataclass(kw_only=True)
class AsynchronousSection:
    """Asynchronous training with bounded staleness (`recipes.async_rollouts`, docs/training.md)."""

    max_staleness: int | None = option(
        None,
        "sample the rollouts of the next steps while the trainer updates, each with the policy of at most this "
        "many updates before (the rollout of step j with the policy after max(0, j - N) updates; samples weighed "
        "by grpo.off_policy_correction); 0: the same run as the synchronous loop; null: the synchronous loop",
    )

    def __post_init__(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (or null: synchronous), got {self.max_staleness}")


@dataclass(kw_only=True)
class Config(TrainingConfig):
    grpo: GRPOSettings = option(factory=GRPOSettings)
    # `async` is a Python keyword; the section is a dataclass field.
    asynchronous: AsynchronousSection = option(factory=AsynchronousSection)
    output_dir: str = option("outputs/grpo", "folder for metrics, plots, sample grids and the final LoRA")

    @classmethod
    def value_problems(cls, values: dict) -> list[str]:
        problems = super().value_problems(values)
        if values.get("policy") == "full":
            asynchronous, grpo = values.get("asynchronous"), values.get("grpo")
            if asynchronous is not None and asynchronous.max_staleness is not None:
                problems.append(
                    "policy full trains synchronously (each step's weights go to the engine): null "
                    "asynchronous.max_staleness"
                )
            if grpo is not None and grpo.off_policy_correction != "none":
                problems.append(
                    "policy full has no behaviour adapters to correct with: set grpo.off_policy_correction: none"
                )
        return problems

    @classmethod
    def sampling_problems(cls, sampling: SamplingParams) -> list[str]:
        if sampling.sampler == "ode":
            return ["sampling.sampler 'ode' has no log-probs for GRPO; use flow_sde, cps or dance_sde"]
        if not any(sampling.sde_mask()):
            return [f"sampling.sde_window {sampling.sde_window} holds no step; GRPO trains on the SDE steps"]
        return []


def run(config: Config) -> dict:
    # The loop and the update import torch: imported when the recipe runs, so that its config is
    # checked without them.
    from recipes.training import train
    from trainers_adapters.grpo.trainer import grpo_step

    def update(policy, optimizer, rollout, generator, policy_version, behaviour, ranks):
        return grpo_step(policy, optimizer, rollout, config.grpo, generator, policy_version, behaviour, ranks)

    def postfix(stats) -> dict:
        return {"log_ratio0": f"{stats.log_ratio_before_update:.1e}"}

    reference = config.grpo.kl_beta > 0  # the KL term's
    return train(config, update, postfix, max_staleness=config.asynchronous.max_staleness, reference=reference)
