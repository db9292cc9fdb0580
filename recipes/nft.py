"""DiffusionNFT training (Zheng et al., arXiv 2509.16117) of a LoRA policy: the engine samples
with an old-policy adapter (deterministic ODE, no CFG), the trainer moves the current adapter with
the implicit-policy loss on the clean samples, and the old adapter follows it by EMA; the engine
holds both.

    python -m recipes.run recipes/configs/nft_tiny.yaml

See `recipes.training` for the loop and the files a run writes, and
`trainers_adapters.nft.trainer` for the update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from recipes.config import option
from recipes.training_config import TrainingConfig
from rollout import SamplingParams
from trainers_adapters.nft.settings import NFTSettings

if TYPE_CHECKING:
    from trainers_adapters.policy.lora_policy import LoraPolicy
    from trainers_adapters.policy.old_policy import OldPolicy

OLD_ADAPTER = "old"  # the name the old policy's adapter has in the engine


@dataclass(kw_only=True)
class Config(TrainingConfig):
    sampling: SamplingParams = option(factory=lambda: SamplingParams(sampler="ode", guidance_scale=1.0))
    nft: NFTSettings = option(factory=NFTSettings)
    output_dir: str = option("outputs/nft", "folder for metrics, plots, sample grids and the final LoRA")

    @classmethod
    def sampling_problems(cls, sampling: SamplingParams) -> list[str]:
        if sampling.sampler != "ode":
            return [
                f"sampling.sampler is {sampling.sampler!r}; DiffusionNFT samples the old policy deterministically: "
                "use ode"
            ]
        return []

    @classmethod
    def value_problems(cls, values: dict) -> list[str]:
        problems = super().value_problems(values)
        if values.get("sde_window_range") is not None:
            problems.append("sde_window_range slides an SDE window; DiffusionNFT's ODE rollouts have none: null it")
        if values.get("policy") == "full":
            problems.append("policy full: DiffusionNFT's old policy is a second adapter; train a LoRA (policy: lora)")
        return problems


def run(config: Config) -> dict:
    # The loop, the update and the old policy import torch: imported when the recipe runs, so that
    # its config is checked without them.
    from recipes.training import train
    from trainers_adapters.nft.trainer import nft_step
    from trainers_adapters.policy.old_policy import OldPolicy

    old: OldPolicy | None = None  # made by `attach` when `train` has built the policy

    def attach(policy: LoraPolicy) -> OldPolicy:
        nonlocal old
        old = OldPolicy(policy, OLD_ADAPTER)
        return old

    def update(policy, optimizer, rollout, generator, policy_version, behaviour, ranks):
        return nft_step(policy, old, optimizer, rollout, config.nft, generator, ranks)

    def check_cfg_free(adapter) -> None:
        _check_cfg_free(config.sampling, adapter.spec)

    def postfix(stats) -> dict:
        return {"old_decay": f"{stats.old_decay:.3f}"}

    return train(config, update, postfix, old_policy=attach, check_model=check_cfg_free)


def _check_cfg_free(sampling: SamplingParams, spec) -> None:
    """Refuse CFG before the engine loads: the loss trains the conditional velocity alone."""
    if spec.cfg_field is None:
        return
    scale = getattr(sampling, spec.cfg_field)
    scale = spec.guidance_defaults.get(spec.cfg_field) if scale is None else scale
    if scale is not None and scale > spec.cfg_threshold:
        raise ValueError(
            f"sampling.{spec.cfg_field} is {scale}, which turns on classifier-free guidance for this model; "
            f"DiffusionNFT samples and trains without CFG: set sampling.{spec.cfg_field}={spec.cfg_threshold:g}"
        )
