"""What a training loop needs from the engine, one folder per algorithm beside what they share:

- `grpo/`: GRPO (Flow-GRPO, DanceGRPO): the loss and its KL to the reference (`loss`), the knobs
  (`settings`), one update from a rewarded rollout (`trainer`), off-policy corrections for
  asynchronous training (`off_policy`) and tree rollouts' advantages (`tree`, BranchGRPO);
- `dpo/`: online Diffusion-DPO, and `nft/`: DiffusionNFT, each as `loss`, `settings`, `trainer`;
- `advantages`: group-relative advantages (GRPO's trees and DiffusionNFT);
- `policy/`: the trainer's trainable LoRA copy of the policy (`lora_policy`), a decoupled
  algorithm's old policy (`old_policy`), re-scoring in micro-batches (`micro_batches`) and the
  end of every update (`optim`: finite checks, clipping, the optimizer step);
- `weights/`: the trainer's side of the engine's weights: the broadcast group (`broadcast`) and the
  checksum (`checksum`);
- `rewards/`: the rewards, where they run, and the reward service.

The public names, in one table; each is imported from its module on first use (PEP 562), so
`import trainers_adapters` costs nothing and `from trainers_adapters import GRPOSettings` brings no
torch (a recipe checks its config before anything loads).
"""

from __future__ import annotations

from rollout.imports import lazy_public_names

PUBLIC_NAMES = {
    # GRPO.
    "GRPOSettings": "trainers_adapters.grpo.settings",
    "grpo_step": "trainers_adapters.grpo.trainer",
    "GRPOStepStats": "trainers_adapters.grpo.trainer",
    "PolicyDriftError": "trainers_adapters.grpo.trainer",
    "grpo_policy_loss": "trainers_adapters.grpo.loss",
    "kl_to_reference": "trainers_adapters.grpo.loss",
    "build_tree": "trainers_adapters.grpo.tree",
    "tree_advantages": "trainers_adapters.grpo.tree",
    "RolloutTree": "trainers_adapters.grpo.tree",
    "group_advantages": "trainers_adapters.advantages",
    # DPO and DiffusionNFT.
    "DPOSettings": "trainers_adapters.dpo.settings",
    "dpo_step": "trainers_adapters.dpo.trainer",
    "DPOStepStats": "trainers_adapters.dpo.trainer",
    "dpo_loss": "trainers_adapters.dpo.loss",
    "NFTSettings": "trainers_adapters.nft.settings",
    "nft_step": "trainers_adapters.nft.trainer",
    "NFTStepStats": "trainers_adapters.nft.trainer",
    "nft_loss": "trainers_adapters.nft.loss",
    # The policy the trainer moves, and the end of every update.
    "LoraPolicy": "trainers_adapters.policy.lora_policy",
    "OldPolicy": "trainers_adapters.policy.old_policy",
    "DecaySchedule": "trainers_adapters.policy.old_policy",
    "check_finite_loss": "trainers_adapters.policy.optim",
    "clip_and_step": "trainers_adapters.policy.optim",
    "NonFiniteUpdateError": "trainers_adapters.policy.optim",
    # The weights the trainer sends.
    "WeightBroadcaster": "trainers_adapters.weights.broadcast",
    "join_engine": "trainers_adapters.weights.broadcast",
    "weights_checksum": "trainers_adapters.weights.checksum",
    # Rewards.
    "Reward": "trainers_adapters.rewards.builtin",
    "get_reward": "trainers_adapters.rewards.builtin",
    "generate_with_rewards": "trainers_adapters.rewards.rewarded_rollout",
    "RewardedRollout": "trainers_adapters.rewards.rewarded_rollout",
    "RewardError": "trainers_adapters.rewards.checks",
    "CompositeReward": "trainers_adapters.rewards.composite",
    "RewardComponent": "trainers_adapters.rewards.composite",
    "groupwise": "trainers_adapters.rewards.composite",
    "RewardSpec": "trainers_adapters.rewards.spec",
    "RewardWorkerPool": "trainers_adapters.rewards.worker_pool",
    "RayRewardPool": "trainers_adapters.rewards.ray_pool",
    "RemoteReward": "trainers_adapters.rewards.remote",
    "ClipScore": "trainers_adapters.rewards.models.clip_score",
    "PickScore": "trainers_adapters.rewards.models.pickscore",
    "AestheticScore": "trainers_adapters.rewards.models.aesthetic",
}

__all__, __getattr__, __dir__ = lazy_public_names(__name__, PUBLIC_NAMES, globals())
