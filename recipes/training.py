"""What the training recipes (GRPO, DPO, DiffusionNFT) share: the training loop around one update
function (their config: `recipes.training_config`).

Every step: pick prompts, roll them out with the policy's adapter (each group rewarded as soon as it
finishes, on a background thread or in `reward_workers` reward workers: processes or Ray actors), run the update,
push the adapter back to the engine and check the version it reports. The run writes, under
`output_dir`: `metrics.jsonl` (one line per step), `reward.png` (reward against step),
`log_ratio.png` (GRPO: max |log ratio| per denoising step before each update), `samples_start.png` /
`samples_end.png` (the same eval prompts and noise before and after training; animated `.gif` grids
for a video model), `lora/` (the final adapter in the diffusers LoRA format) and `summary.json`. The
step records and grids also go to the loggers that `logger` names (`recipes.loggers`: TensorBoard,
wandb).

With `checkpoint_every`, also `checkpoints/step-NNNNNN/` (see `recipes.checkpoint`), from which
`resume` continues the run as if it had not stopped: the rollout seeds and the SDE window are
derived from the seed and the step, and every generator the loop draws from (prompt order,
minibatch order, torch's global one) is restored.

Launched by torchrun (`torchrun --nproc-per-node N -m recipes.run CONFIG`), the loop runs on N
data-parallel trainer ranks (`trainers_adapters.data_parallel`): each trains on its share of the
step's groups, the gradients are summed over the ranks, and every rank holds the same LoRA after
each update, the one a single rank would hold with the same global batch. `trainer.placement`
says who samples: colocated, every rank its own share with its own engine; separate, rank 0 the
whole step with the one engine, which hands each rank its share. Rank 0 alone writes the run's
files and logs; a checkpoint is rank 0's, which every rank resumes from.

A decoupled algorithm (DiffusionNFT) passes `old_policy`: the rollouts then sample with that
second adapter, which the engine holds next to the policy's (both pushed after every update),
and checkpoints carry it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from recipes.async_rollouts import RolloutsAhead
from recipes.checkpoint import (
    OLD_POLICY,
    TrainingState,
    drop_later_checkpoints,
    read_behaviour,
    read_resumable,
    resume_folder,
    write_checkpoint,
)
from recipes.config import check_setup, to_dict
from recipes.loggers import open_loggers
from recipes.memory_plan import meta_adapter
from recipes.plots import plot_log_ratio, plot_reward
from recipes.randomness import PromptOrder, restore_rng, rng_state
from recipes.rollout import save_samples
from recipes.training_config import POLICY_ADAPTER, TrainingConfig
from rollout import RolloutEngine, SamplingParams
from rollout.rescoring import RATIO_TOLERANCE  # the contract the first update's |log ratio| meets
from rollout.seeding import derive_seed
from trainers_adapters.data_parallel.rollout_shares import gather_rollout, scatter_rollout
from trainers_adapters.data_parallel.trainer_ranks import TrainerRanks
from trainers_adapters.policy.full_policy import FullPolicy
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.old_policy import OldPolicy
from trainers_adapters.rewards.placement import open_reward_runner
from trainers_adapters.rewards.rewarded_rollout import RewardedRollout, generate_with_rewards
from trainers_adapters.rewards.runner import RewardRunner
from trainers_adapters.rewards.spec import reward_label

logger = logging.getLogger(__name__)


def slide_window(params: SamplingParams, window_range: tuple[int, int], rng: random.Random) -> SamplingParams:
    """`params` with its SDE window moved to a start drawn uniformly so that the window stays inside
    `window_range`; branch steps keep their offsets from the window's start."""
    start, stop = params.sde_window
    new_start = rng.randint(window_range[0], window_range[1] - (stop - start))
    shift = new_start - start
    return dataclasses.replace(
        params,
        sde_window=(new_start, new_start + stop - start),
        branch_steps=tuple(step + shift for step in params.branch_steps),
    )


def _step_params(config: TrainingConfig, params: SamplingParams, step: int) -> SamplingParams:
    """The sampling params of `step`'s rollout: its seed, and its SDE window where it slides;
    derived from the run's seed and the step alone."""
    step_params = dataclasses.replace(params, seed=derive_seed(config.seed, step, 0, "rollout"))
    if config.sde_window_range is not None:
        window_rng = random.Random(derive_seed(config.seed, step, 0, "sde_window"))
        step_params = slide_window(step_params, config.sde_window_range, window_rng)
    return step_params


# update(policy, optimizer, rollout, generator, policy_version, behaviour, ranks) -> a dataclass of
# statistics for metrics.jsonl; policy_version: the engine weight version of the policy before the
# update; behaviour: the asynchronous loop's adapters that sampled the rollout, by weight version
# (None: synchronous); ranks: the data-parallel trainer ranks, which the rollout is shared among.
UpdateFn = Callable[
    [LoraPolicy, torch.optim.Optimizer, RewardedRollout, torch.Generator, int, dict[int, dict] | None, TrainerRanks],
    Any,
]


def train(
    config: TrainingConfig,
    update: UpdateFn,
    postfix: Callable[[Any], dict],
    old_policy: Callable[[LoraPolicy], OldPolicy] | None = None,
    max_staleness: int | None = None,
    check_model: Callable[[Any], None] | None = None,
    reference: bool = False,
) -> dict:
    """Run the training loop; returns the summary written to summary.json. `postfix` picks the
    update statistics shown in the progress bar. `old_policy(policy)`, if given, makes the adapter
    the rollouts sample with instead of the policy's own (the evals still show the policy).
    `max_staleness` N: sample the rollouts of the next steps while the trainer updates, with the
    policy of N updates before (`recipes.async_rollouts`); None: one after the other. `check_model`,
    if given, checks the model's pipeline adapter (built on the meta device: no weights) before
    anything loads and raises ValueError for a model the recipe cannot train. `reference`: the
    update uses the reference policy (a KL term, DPO), which a full policy keeps a copy of. Under torchrun,
    every rank runs this (see the module's docstring); rank 0 returns the summary, the others {}."""
    check_setup(config)  # the model folder and a rollout service's answer, before anything is written or loaded
    if max_staleness is not None and old_policy is not None:
        raise ValueError("asynchronous training (max_staleness) is GRPO's; a decoupled old policy samples already")
    joins = not dist.is_initialized()  # a process group this run makes is this run's to end
    ranks = TrainerRanks.from_environment(config.engine.device, always_join=config.policy == "full")
    try:
        return _train(config, update, postfix, old_policy, max_staleness, check_model, reference, ranks)
    finally:
        if joins and dist.is_initialized():
            dist.destroy_process_group()


def _placement_problems(config: TrainingConfig, ranks: TrainerRanks, max_staleness: int | None) -> list[str]:
    if ranks.world_size == 1:
        return []
    problems = []
    if config.prompts_per_step < ranks.world_size:
        problems.append(
            f"prompts_per_step {config.prompts_per_step} gives some of the {ranks.world_size} ranks no group to train "
            f"on: set it to at least {ranks.world_size} (each rank trains on whole groups)"
        )
    if config.trainer.placement == "colocated" and config.engine.url is not None:
        problems.append(
            f"trainer.placement colocated gives each of the {ranks.world_size} ranks its own engine, but engine.url "
            "names one server for all: set trainer.placement: separate (rank 0 samples there and shares the step)"
        )
    if config.trainer.placement == "separate" and max_staleness is not None:
        problems.append(
            "asynchronous training (asynchronous.max_staleness) on several ranks samples on every rank: set "
            "trainer.placement: colocated"
        )
    return problems


def _rank_engine(config: TrainingConfig, ranks: TrainerRanks):
    """The engine section of this rank: on a GPU, each rank's engine and policy on its own
    (torchrun's LOCAL_RANK) unless the config names one."""
    device = config.engine.device
    if ranks.world_size == 1 or device != "cuda":
        return config.engine
    local = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    torch.cuda.set_device(local)
    return dataclasses.replace(config.engine, device=local)


def _train(
    config: TrainingConfig,
    update: UpdateFn,
    postfix: Callable[[Any], dict],
    old_policy: Callable[[LoraPolicy], OldPolicy] | None,
    max_staleness: int | None,
    check_model: Callable[[Any], None] | None,
    reference: bool,
    ranks: TrainerRanks,
) -> dict:
    problems = _placement_problems(config, ranks, max_staleness)
    if problems:
        raise ValueError(f"invalid config for {ranks.world_size} trainer ranks: " + "; ".join(problems))
    colocated = config.trainer.placement == "colocated"
    samples = colocated or ranks.is_main  # this rank opens an engine and rewards, and samples
    prompts = config.all_prompts()
    output_dir = Path(config.output_dir)
    resumed_from = resume_folder(config.resume, output_dir)
    resumed = read_resumable(resumed_from, to_dict(config)) if resumed_from is not None else None
    output_dir.mkdir(parents=True, exist_ok=True)
    # Rank 0 builds a tiny model's folder (once), the others then find it.
    model_path = ranks.broadcast(config.model.resolve_path() if ranks.is_main else None)
    engine_section = _rank_engine(config, ranks)
    engine_section.to_engine_config(model_path)  # checks the model folder (and engine settings) before any load
    if check_model is not None:
        check_model(meta_adapter(model_path, getattr(torch, engine_section.dtype)))
    generator = torch.Generator().manual_seed(config.seed)
    prompt_order = PromptOrder(prompts, config.seed)
    edit_images = config.input_images.for_prompts(prompts)  # prompt -> its input images, or None
    history: list[dict] = []
    first_step, train_s_before = 0, 0.0
    if resumed is not None:
        history, first_step, train_s_before = resumed[0].history, resumed[0].step, resumed[0].train_s
        if ranks.is_main:
            drop_later_checkpoints(output_dir, first_step)
        logger.info("resuming from %s: step %d of %d", resumed_from, first_step, config.steps)
    started = time.perf_counter()
    with (
        open_loggers(
            config.logger if ranks.is_main else [], output_dir, to_dict(config), config.wandb, done=history
        ) as loggers,
        _open_rewards(config) if samples else contextlib.nullcontext() as rewards,
        engine_section.open_engine(model_path) if samples else contextlib.nullcontext() as engine,
    ):
        policy = _trainer_policy(config, engine_section, model_path, engine, reference)
        if engine is not None and not (policy.sharded or policy.shares_base):  # another model folder: said now
            policy.check_same_base(engine)
        old = old_policy(policy) if old_policy is not None else None
        optimizer = torch.optim.AdamW(
            policy.parameters(), lr=config.optimizer.learning_rate, weight_decay=config.optimizer.weight_decay
        )
        params = dataclasses.replace(config.sampling, lora=policy.name if old is None else old.name)
        if resumed is not None:
            policy.load(resumed_from / policy.saved_as)
            if old is not None:
                old.load(resumed_from / OLD_POLICY)
            policy.load_optimizer_state(optimizer, resumed[1])

        def push(version: int | None = None) -> int:  # the version the next samples carry, on every rank
            # A sharded policy's ranks all gather each tensor; those without an engine drop it.
            pushed = _push(engine, policy, old, version=version) if engine is not None or policy.sharded else None
            return pushed if colocated else ranks.broadcast(pushed)

        def push_snapshot(state: dict, push_version: int) -> int:  # an adapter the rollouts sample with
            return engine.load_lora(policy.name, state, policy.lora_config, version=push_version)

        if max_staleness is not None:  # the adapters the first rollouts sample with, by the updates they had
            snapshots = {0: policy.lora_state()} if resumed is None else read_behaviour(resumed_from)
            snapshots[first_step] = policy.lora_state()
            first_index = max(0, first_step - max_staleness)
        # A resumed run re-pushes its adapter with the checkpoint's version, so the numbering (and
        # the check that samples carry the version last pushed) goes on, on a fresh server as on the same.
        if max_staleness is None or resumed is None:
            version = push(None if resumed is None else resumed[0].weight_version)
        else:  # the first rollout's adapter, before the generators are restored (see below)
            version = resumed[0].weight_version
            push_snapshot(snapshots[first_index], version - first_step + first_index)
        if resumed is None and ranks.is_main:
            eval_start = _eval_samples(engine, config, prompts, rewards, edit_images, policy.name)
            samples_start = save_samples(eval_start.outputs, config.grid_scale, output_dir / "samples_start")
            loggers.log_images(0, {"samples_start": samples_start})
            eval_reward_start = float(eval_start.rewards.mean())
        elif resumed is None:
            eval_reward_start = None  # rank 0's, which alone writes it
        else:  # after the push: an engine in this process draws from torch's generator
            restore_rng(resumed[0].rng, prompt_order, generator)
            eval_reward_start = resumed[0].eval_reward_start
        steps = range(first_step, config.steps)
        # Where the prompt order stands before each step takes its prompts: the sampler may have
        # taken those of later steps by the time a checkpoint is written.
        prompt_states = {first_step: prompt_order.state()}

        def sample_step(step: int, stop: threading.Event | None) -> RewardedRollout | None:
            """This rank's part of the step's rollout: its share of the prompts (colocated), the whole
            step (rank 0, separate) or nothing (another rank, separate)."""
            taken = prompt_order.take(config.prompts_per_step)
            prompt_states[step + 1] = prompt_order.state()
            if engine is None:
                return None
            share = ranks.share(len(taken)) if colocated else range(len(taken))
            mine = [taken[index] for index in share]
            images = None if edit_images is None else [edit_images[prompt] for prompt in mine]
            step_params = _step_params(config, params, step)
            prefix = f"step{step}-"
            return generate_with_rewards(engine, mine, step_params, rewards, None, prefix, images, stop, share.start)

        def shared(part: RewardedRollout | None) -> RewardedRollout:  # the step's rollout, as this rank trains on it
            return gather_rollout(ranks, part) if colocated else scatter_rollout(ranks, part)

        ahead = None
        if max_staleness is not None:
            base_version = version - first_step  # the adapter after k updates is version base + k
            ahead = RolloutsAhead(
                sample_step, push_snapshot, steps, max_staleness, base_version, snapshots, first_index
            )
        bar = tqdm(
            steps, desc=config.recipe, unit="step", initial=first_step, total=config.steps, disable=not ranks.is_main
        )
        sleep_level = config.trainer.engine_sleep  # colocated and synchronous only (the config check)
        with ahead if ahead is not None else contextlib.nullcontext():
            for step in bar:
                wait_started = time.perf_counter()
                if ahead is None:
                    rollout = shared(sample_step(step, None))
                    stale = {o.weight_version for o in rollout.outputs} - {version}
                    if stale:
                        raise RuntimeError(f"step {step}: samples carry weight versions {stale}, expected {version}")
                    behaviour = None
                else:
                    rollout = shared(ahead.rollout(step))
                    version = ahead.version_of(step)  # the policy's, pushed or not
                    behaviour = ahead.behaviour_of(rollout)
                wait_s = time.perf_counter() - wait_started
                update_started = time.perf_counter()
                if sleep_level:  # the update gets the engine's weight memory (trainer.engine_sleep)
                    engine.sleep(sleep_level)
                stats = update(policy, optimizer, rollout, generator, version, behaviour, ranks)
                update_s = time.perf_counter() - update_started
                push_started = time.perf_counter()
                if sleep_level:
                    engine.wake_up()  # level 2 reloads the folder's weights at version 0: the push numbers on
                if ahead is None:
                    new_version = push(version + 1 if sleep_level == 2 else None)
                    if new_version <= version:
                        raise RuntimeError(
                            f"step {step}: the push returned weight version {new_version}, not above {version}"
                        )
                else:  # the sampler pushes it when a rollout needs it
                    ahead.publish(step + 1, policy.lora_state())
                    new_version = ahead.version_of(step + 1)
                push_s = time.perf_counter() - push_started
                record = _step_record(step, rollout, stats, new_version, update_s, push_s)
                window = _step_params(config, params, step).sde_window
                record["sde_window"] = list(window) if window is not None else None
                record["sample_staleness"] = _staleness_counts(rollout, version)
                record["trainer_wait_s"] = wait_s  # the trainer idle, waiting for this step's rollout
                record["wall_s"] = train_s_before + time.perf_counter() - started
                version = new_version
                if step == 0:
                    _log_first_ratio(record)
                history.append(record)
                loggers.log_scalars(step, record)
                bar.set_postfix(reward=f"{record['reward_mean']:.4f}", **postfix(stats))
                every = config.checkpoint_every
                writes = ranks.is_main or policy.sharded  # a sharded policy's ranks all gather their shards
                if writes and every and ((step + 1) % every == 0 or step + 1 == config.steps):
                    rng = rng_state(prompt_order, generator) | {"prompt_order": prompt_states[step + 1]}
                    state = TrainingState(
                        step=step + 1,
                        weight_version=version,
                        history=history,
                        eval_reward_start=eval_reward_start,
                        train_s=train_s_before + time.perf_counter() - started,
                        config=to_dict(config),
                        rng=rng,
                    )
                    behaviour = ahead.pending_snapshots(step + 1) if ahead is not None else None
                    write_checkpoint(
                        output_dir,
                        state,
                        policy,
                        optimizer,
                        config.keep_checkpoints,
                        old_policy=old,
                        behaviour=behaviour,
                        main=ranks.is_main,
                    )
                prompt_states.pop(step, None)
                if ahead is not None:
                    ahead.forget_before(step + 1)
        if ahead is not None and ahead.pushed != config.steps:  # the final policy, for the eval
            policy.push(engine, version=version)
        # A sharded policy's ranks all gather their shards for rank 0's final weights.
        saved = policy.save(output_dir / policy.saved_as, write=ranks.is_main) if policy.sharded else None
        if not ranks.is_main:
            return {}
        eval_end = _eval_samples(engine, config, prompts, rewards, edit_images, policy.name)
        # After `steps` updates: the x position that follows the last step's scalars.
        samples_end = save_samples(eval_end.outputs, config.grid_scale, output_dir / "samples_end")
        loggers.log_images(config.steps, {"samples_end": samples_end})
    train_s = train_s_before + time.perf_counter() - started

    plot_reward(history, output_dir / "reward.png", title=f"{config.recipe}: reward {reward_label(config.reward)}")
    if history and "log_ratio_by_step_max" in history[0]:  # GRPO's; DPO has no policy ratio
        plot_log_ratio(history, output_dir / "log_ratio.png", title=f"{config.recipe}: rollout/train agreement")
    saved = saved if saved is not None else policy.save(output_dir / policy.saved_as)
    summary = _summary(config, history, eval_reward_start, eval_end, train_s, model_path, saved, policy.sharded)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info(
        "done in %.1f s: mean reward of the first 5 steps %.4f, of the last 5 %.4f (margin %+.4f); "
        "eval reward %.4f -> %.4f. Wrote %s",
        train_s,
        summary["reward_first5"],
        summary["reward_last5"],
        summary["reward_margin"],
        summary["eval_reward_start"],
        summary["eval_reward_end"],
        output_dir,
    )
    return summary


def _trainer_policy(
    config: TrainingConfig, engine_section, model_path: str, engine, reference: bool
) -> LoraPolicy | FullPolicy:
    """The policy the trainer trains: every weight of the denoisers (`policy: full`, sharded over
    the ranks, with a reference copy if the update needs one), or a LoRA over the base weights of
    an engine in this process (one copy of the base: `LoraPolicy.sharing_base`), else over a copy
    of its own denoisers' model."""
    if config.policy == "full":
        return FullPolicy(
            model_path,
            device=engine_section.device,
            dtype=getattr(torch, engine_section.dtype),
            attention_backend=config.engine.attention_backend,
            gradient_checkpointing=config.trainer.gradient_checkpointing,
            keep_reference=reference,
        )
    torch.manual_seed(config.seed)  # what draws from the global generator from here on
    in_process = isinstance(engine, RolloutEngine) and engine.executor.shares_memory
    if in_process and config.trainer.share_base:
        return LoraPolicy.sharing_base(
            engine, config.lora.peft_config(), POLICY_ADAPTER, config.trainer.gradient_checkpointing, config.seed
        )
    return LoraPolicy(
        model_path,
        config.lora.peft_config(),
        name=POLICY_ADAPTER,
        device=engine_section.device,
        dtype=getattr(torch, engine_section.dtype),
        attention_backend=config.engine.attention_backend,  # re-scores with the kernel that sampled
        compile=config.engine.compile,
        gradient_checkpointing=config.trainer.gradient_checkpointing,
        seed=config.seed,  # the LoRA's initial values, the same as a shared base's
    )


def _open_rewards(config: TrainingConfig):
    return open_reward_runner(
        config.reward,
        config.reward_workers,
        runner=config.reward_runner,
        devices=config.reward_devices,
        timeout_s=config.reward_timeout_s,
    )


def _push(engine, policy: LoraPolicy, old: OldPolicy | None, version: int | None = None) -> int:
    """Push the policy's adapter (then the old policy's, when there is one); returns the weight
    version the next samples carry (`version`: a resumed run's)."""
    if old is None:
        return policy.push(engine, version=version)
    policy.push(engine)
    return old.push(engine, version=version)


def _eval_samples(
    engine, config: TrainingConfig, prompts: list[str], rewards: RewardRunner, edit_images: dict | None, lora
) -> RewardedRollout:
    params = dataclasses.replace(
        config.sampling,
        lora=lora,  # the policy's adapter; None: a full policy's weights, which the engine holds
        num_samples=config.eval.num_samples,
        num_inference_steps=config.eval.num_inference_steps,
        sampler=config.eval.sampler,
        sde_window=None,
        seed=config.eval.seed,
        sigmas=None,  # the eval's step count may differ
        branch_steps=(),  # one plain sample per grid cell
        branch_noise_scale=1.0,
        record=(),
        record_steps=None,
    )
    prompts = prompts[: config.eval.num_prompts]
    images = None if edit_images is None else [edit_images[prompt] for prompt in prompts]
    return generate_with_rewards(engine, prompts, params, rewards, None, "eval", images)


def _step_record(step: int, rollout: RewardedRollout, stats, version: int, update_s: float, push_s: float) -> dict:
    rewards = rollout.rewards
    return {
        "step": step,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "reward_min": float(rewards.min()),
        "reward_max": float(rewards.max()),
        **{f"reward/{name}": float(scores.mean()) for name, scores in rollout.reward_components.items()},
        "num_samples": len(rollout.outputs),
        **dataclasses.asdict(stats),
        "weight_version": version,
        "rollout_s": rollout.rollout_s,
        "reward_wait_s": rollout.reward_wait_s,
        "update_s": update_s,
        "push_s": push_s,
    }


def _staleness_counts(rollout: RewardedRollout, policy_version: int) -> dict[str, int]:
    """How many samples are how many versions older than the policy that trains on them (by their
    oldest step), as JSON keeps it: {"0": 12, "1": 4}."""
    counts: dict[str, int] = {}
    for output in rollout.outputs:
        age = str(policy_version - min(output.step_weight_versions, default=output.weight_version))
        counts[age] = counts.get(age, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


def _log_first_ratio(record: dict) -> None:
    if record.get("log_ratio_before_update") is None:  # DPO has no policy ratio
        return
    log_ratio = record["log_ratio_before_update"]
    message = "policy ratio before the first update: max |log ratio| = %.2e (ratio within %.2e of 1; must be < %g)"
    if log_ratio < RATIO_TOLERANCE:
        logger.info(message, log_ratio, torch.expm1(torch.tensor(log_ratio)).item(), RATIO_TOLERANCE)
    else:
        logger.warning(
            message + ": the trainer does not re-score rollouts as the engine sampled them (same dtype and "
            "device on both sides?)",
            log_ratio,
            torch.expm1(torch.tensor(log_ratio)).item(),
            RATIO_TOLERANCE,
        )


def _summary(
    config: TrainingConfig,
    history: list[dict],
    eval_reward_start: float,
    eval_end: RewardedRollout,
    train_s: float,
    model_path: str,
    saved: Path,
    full: bool,
) -> dict:
    rewards = [record["reward_mean"] for record in history]
    log_ratios = [r["log_ratio_before_update"] for r in history if r.get("log_ratio_before_update") is not None]
    window = min(5, len(rewards))
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    return {
        "config": to_dict(config),
        "model_path": model_path,
        "steps": len(history),
        "train_s": train_s,
        "reward_first5": first,
        "reward_last5": last,
        "reward_margin": last - first,
        "eval_reward_start": eval_reward_start,
        "eval_reward_end": float(eval_end.rewards.mean()),
        # GRPO's ratio check (DPO has none): before the first update, and its worst step.
        "log_ratio_before_first_update": log_ratios[0] if log_ratios else None,
        "log_ratio_before_update_max": max(log_ratios, default=None),
        "final_weight_version": history[-1]["weight_version"] if history else None,
        # the final LoRA's file, or a full policy's weights: a diffusers folder per denoiser
        "weights_folder" if full else "lora_file": str(saved),
    }
