"""What one trainer rank runs in the data-parallel tests: the GRPO, DPO and DiffusionNFT updates
on its share of saved rollouts, with the gradients summed over a gloo group (spawned processes
import this module; one rank runs it in the test's own process)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime

import torch
import torch.distributed as dist

from trainers_adapters.data_parallel.rollout_shares import gather_rollout, scatter_rollout
from trainers_adapters.data_parallel.trainer_ranks import TrainerRanks
from trainers_adapters.dpo.trainer import DPOSettings, dpo_step
from trainers_adapters.grpo.trainer import GRPOSettings, grpo_step
from trainers_adapters.nft.trainer import NFTSettings, nft_step
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.old_policy import OldPolicy
from trainers_adapters.rewards.rewarded_rollout import RewardedRollout

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


def _join(rank: int, world_size: int, store: str) -> None:
    """This process as `rank` of a gloo group of `world_size` that meets in the file `store`."""
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )


def share_of(whole: RewardedRollout, ranks: TrainerRanks) -> RewardedRollout:
    """The part of `whole` a colocated rank samples itself: its share of the prompts' groups."""
    prompts = list(dict.fromkeys(whole.group_ids.tolist()))
    mine = {prompts[i] for i in ranks.share(len(prompts))}
    kept = [i for i, group in enumerate(whole.group_ids.tolist()) if group in mine]
    return dataclasses.replace(
        whole,
        outputs=[whole.outputs[i] for i in kept],
        rewards=whole.rewards[kept],
        group_ids=whole.group_ids[kept],
        reward_components={name: scores[kept] for name, scores in whole.reward_components.items()},
    )


def updates(rank: int, world_size: int, model: str, rollouts_file: str, results: str, store: str | None) -> None:
    """Run each update from the same initial LoRA on this rank's view of the rollouts and save
    rank 0's adapters and statistics to `results`."""
    if world_size > 1:
        _join(rank, world_size, store)
    try:
        ranks = TrainerRanks(rank, world_size)
        rollouts = torch.load(rollouts_file, weights_only=False)
        sampled, ode = rollouts["grpo"], rollouts["nft"]
        outcome = {}
        torch.set_num_threads(1)

        def fresh_policy() -> LoraPolicy:
            torch.manual_seed(0)
            return LoraPolicy(model, LORA)

        settings = GRPOSettings(optimizer_steps=2, micro_batch_size=3, timestep_fraction=0.75)
        for how, rollout in [
            ("gathered", gather_rollout(ranks, share_of(sampled, ranks))),
            ("scattered", scatter_rollout(ranks, sampled if ranks.is_main else None)),
        ]:
            policy = fresh_policy()
            optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
            stats = grpo_step(policy, optimizer, rollout, settings, torch.Generator().manual_seed(1), ranks=ranks)
            outcome[f"grpo_{how}"] = (policy.lora_state(), dataclasses.asdict(stats))

        policy = fresh_policy()
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        rollout = gather_rollout(ranks, share_of(sampled, ranks))
        stats = dpo_step(
            policy, optimizer, rollout, DPOSettings(micro_batch_size=2), torch.Generator().manual_seed(2), ranks
        )
        outcome["dpo"] = (policy.lora_state(), dataclasses.asdict(stats))

        policy = fresh_policy()
        old = OldPolicy(policy)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        rollout = gather_rollout(ranks, share_of(ode, ranks))
        nft = NFTSettings(optimizer_steps=2, micro_batch_size=3)
        stats = nft_step(policy, old, optimizer, rollout, nft, torch.Generator().manual_seed(3), ranks)
        outcome["nft"] = (
            policy.lora_state() | {f"old.{k}": t.clone() for k, t in old.tensors().items()},
            dataclasses.asdict(stats),
        )
        if ranks.is_main:
            torch.save(outcome, f"{results}/world{world_size}.pt")
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def full_updates(rank: int, world_size: int, model: str, rollouts_file: str, results: str, store: str) -> None:
    """GRPO and DPO updates of every weight (`FullPolicy`, FSDP2 over `world_size` gloo ranks; one
    rank too) on this rank's share of the base model's rollout; rank 0 saves the gathered weights,
    the statistics, and the checksum an engine reports after the push."""
    from rollout import EngineConfig, RolloutEngine
    from rollout.weights.state import checksum
    from trainers_adapters.policy.full_policy import FullPolicy

    _join(rank, world_size, store)
    try:
        torch.set_num_threads(1)
        ranks = TrainerRanks(rank, world_size)
        sampled = torch.load(rollouts_file, weights_only=False)["base"]
        rollout = gather_rollout(ranks, share_of(sampled, ranks))
        outcome = {}
        for update in ("grpo", "dpo"):
            policy = FullPolicy(model, keep_reference=update == "dpo")
            optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
            if update == "grpo":
                settings = GRPOSettings(optimizer_steps=2, micro_batch_size=3, timestep_fraction=0.75)
                stats = grpo_step(policy, optimizer, rollout, settings, torch.Generator().manual_seed(1), ranks=ranks)
            else:
                settings = DPOSettings(micro_batch_size=2)
                stats = dpo_step(policy, optimizer, rollout, settings, torch.Generator().manual_seed(2), ranks)
            weights = dict(policy.full_state("transformer"))
            with RolloutEngine(EngineConfig(model=model)) as engine:
                version = policy.push(engine)
                pushed = engine.weights_checksum()
            outcome[update] = (weights, dataclasses.asdict(stats), version, pushed, checksum(weights))
        # The separate placement: rank 0's engine of two `mp` replicas takes the weights every rank
        # gathers; weights_checksum() refuses replicas that disagree.
        replicas = EngineConfig(model=model, executor="mp", num_workers=2)
        with RolloutEngine(replicas) if ranks.is_main else contextlib.nullcontext() as engine:
            policy.push(engine)
            outcome["mp_replicas"] = engine.weights_checksum() if engine is not None else None
        if ranks.is_main:
            torch.save(outcome, f"{results}/full_world{world_size}.pt")
    finally:
        dist.destroy_process_group()
