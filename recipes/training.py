"""What the GRPO and DPO recipes share: their config sections and the training loop around one
update function.

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

A decoupled algorithm (DiffusionNFT) passes `old_policy`: the rollouts then sample with that
second adapter, which the engine holds next to the policy's (both pushed after every update),
and checkpoints carry it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from recipes.checkpoint import (
    OLD_POLICY,
    TrainingState,
    drop_later_checkpoints,
    read_resumable,
    resume_folder,
    resume_problems,
    write_checkpoint,
)
from recipes.config import EngineSection, ModelSection, RecipeConfig, check_model, option, to_dict
from recipes.edit_images import InputImagesSection
from recipes.loggers import WandbSection, logger_problems, open_loggers
from recipes.plots import plot_log_ratio, plot_reward
from recipes.randomness import PromptOrder, restore_rng, rng_state
from recipes.rollout import save_samples
from rollout import SamplingParams
from rollout.rescoring import RATIO_TOLERANCE  # the contract the first update's |log ratio| meets
from rollout.seeding import derive_seed
from trainers_adapters.lora_policy import LoraPolicy
from trainers_adapters.old_policy import OldPolicy
from trainers_adapters.rewards.placement import open_reward_runner, placement_problems
from trainers_adapters.rewards.rewarded_rollout import RewardedRollout, generate_with_rewards
from trainers_adapters.rewards.runner import RewardRunner
from trainers_adapters.rewards.spec import reward_label, reward_problems

logger = logging.getLogger(__name__)

POLICY_ADAPTER = "policy"  # the name the trained adapter has in the engine


@dataclass(kw_only=True)
class LoraSection:
    rank: int = option(8, "LoRA rank r")
    alpha: float = option(16.0, "LoRA alpha (the update is scaled by alpha / rank)")
    target_modules: list[str] | None = option(
        None, "transformer module names (or name suffixes) that get a LoRA; null: the model family's default"
    )

    def __post_init__(self) -> None:
        problems = []
        if self.rank < 1:
            problems.append(f"rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            problems.append(f"alpha must be > 0, got {self.alpha}")
        if self.target_modules == []:
            problems.append("target_modules is empty; name at least one module (e.g. to_q), or null for the default")
        if problems:
            raise ValueError("; ".join(problems))

    def peft_config(self) -> dict:
        """The LoRA's config; without target_modules `LoraPolicy` takes the family's default targets."""
        config = {"r": self.rank, "lora_alpha": self.alpha}
        if self.target_modules is not None:
            config["target_modules"] = list(self.target_modules)
        return config


@dataclass(kw_only=True)
class OptimizerSection:
    learning_rate: float = option(3e-4, "AdamW learning rate of the LoRA parameters")
    weight_decay: float = option(0.0, "AdamW weight decay")

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


@dataclass(kw_only=True)
class EvalSection:
    """The fixed-noise samples drawn before and after training (samples_start/end.png)."""

    num_prompts: int = option(4, "how many of the training prompts (the first ones) make the eval grids' rows")
    num_samples: int = option(4, "samples per eval prompt (the grids' columns)")
    num_inference_steps: int = option(10, "denoising steps of the eval samples")
    sampler: str = option("ode", "update rule of the eval samples (ode: deterministic, as Flow-GRPO evaluates)")
    seed: int = option(1234, "seed of the eval samples' noise, the same at the start and the end")

    def __post_init__(self) -> None:
        problems = []
        for name in ("num_prompts", "num_samples", "num_inference_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(kw_only=True)
class TrainingConfig(RecipeConfig):
    model: ModelSection = option(factory=ModelSection)
    engine: EngineSection = option(factory=EngineSection)
    sampling: SamplingParams = option(factory=lambda: SamplingParams(sampler="flow_sde", noise_level=0.7))
    lora: LoraSection = option(factory=LoraSection)
    optimizer: OptimizerSection = option(factory=OptimizerSection)
    eval: EvalSection = option(factory=EvalSection)
    # A bare dict: its entries are checked by reward_problems, which names each bad one, not as one type error.
    reward: str | dict = option(
        help="one reward by name (a built-in such as colour or jpeg_compressibility, a reward model: clip_score, "
        "pickscore, aesthetic, or a dotted path), or a mapping name -> {weight, reward model settings} for a "
        "weighted sum, each component logged as reward/<name> (docs/training.md)"
    )
    reward_workers: int = option(
        0,
        "reward worker processes, each holding the reward's models once (on the device its settings name), "
        "scoring each group as it finishes; 0: on a thread of the trainer's process (docs/training.md)",
    )
    reward_runner: str = option(
        "process", "what a reward worker is: process (spawned on this machine) or ray (a Ray actor, on a cluster)"
    )
    reward_devices: list[str] | None = option(
        None,
        "one device per reward worker (cpu, cuda:1; with ray: cpu or cuda, a GPU Ray picks), where it builds the "
        "reward's models; null: where each reward's own device setting says",
    )
    reward_timeout_s: float = option(
        600.0,
        "the longest a reward worker may take over one group; past it the step fails and the worker is restarted",
    )
    prompts: list[str] = option(help="training prompts; each step takes `prompts_per_step` of them in turn")
    prompts_file: str | None = option(None, "a text file with one more training prompt per line (optional)")
    prompts_per_step: int = option(4, "prompts per training step; each is sampled sampling.num_samples times")
    input_images: InputImagesSection = option(
        factory=InputImagesSection, help="an edit recipe's input images, one per prompt (null source: none)"
    )
    sde_window_range: tuple[int, int] | None = option(
        None,
        "[start, stop): each step slides sampling.sde_window, and sampling.branch_steps with it, to a random "
        "place inside this range (Flow-GRPO-Fast's sde_window_range); null: the window stays where it is",
    )
    steps: int = option(60, "training steps (one rollout, its updates and one push each)")
    seed: int = option(0, "seed of the LoRA init, prompt order, rollout noise and training randomness")
    output_dir: str = option("outputs/train", "folder for metrics, plots, sample grids and the final LoRA")
    grid_scale: int = option(4, "nearest-neighbour upscale of each image in the sample grids")
    logger: str | list[str] = option(
        factory=lambda: ["jsonl"],
        help="where step metrics and sample grids go, one or a list: jsonl (metrics.jsonl), tensorboard "
        "(output_dir/tensorboard; pip extra [tensorboard]), wandb (the wandb section; pip extra [wandb])",
    )
    wandb: WandbSection = option(factory=WandbSection)
    checkpoint_every: int = option(
        0,
        "write a checkpoint (LoRA, optimizer, generator states, step, metrics) to output_dir/checkpoints "
        "every N steps and after the last; 0: none",
    )
    keep_checkpoints: int = option(1, "how many of the latest checkpoints to keep; older ones go once a newer is in")
    resume: str | None = option(
        None,
        "continue a run: auto (from the latest checkpoint in output_dir, or a new run if there is none), a "
        "checkpoint folder, or an output_dir with checkpoints (as --resume DIR); null: a new run",
    )

    @classmethod
    def value_problems(cls, values: dict) -> list[str]:
        problems = logger_problems(values["logger"]) if "logger" in values else []
        if "reward" in values:
            problems += reward_problems(values["reward"])
        prompts_file = values.get("prompts_file")
        if prompts_file is not None and not Path(prompts_file).is_file():
            problems.append(f"prompts_file {prompts_file!r} does not exist")
        if values.get("prompts") == [] and "prompts_file" in values and prompts_file is None:
            problems.append("prompts is empty and no prompts_file is given; give at least one prompt")
        problems += placement_problems(
            values.get("reward_workers", 0),
            values.get("reward_runner", "process"),
            values.get("reward_devices"),
            values.get("reward_timeout_s", 600.0),
            values.get("reward"),
        )
        for name in ("prompts_per_step", "steps", "grid_scale", "keep_checkpoints"):
            if values.get(name, 1) < 1:
                problems.append(f"{name} must be >= 1, got {values[name]}")
        if values.get("checkpoint_every", 0) < 0:
            problems.append(f"checkpoint_every must be >= 0 (0: no checkpoints), got {values['checkpoint_every']}")
        if "resume" in values and "output_dir" in values:
            problems += resume_problems(values["resume"], values["output_dir"])
        sampling = values.get("sampling")
        if sampling is not None:
            problems += _sampling_problems(sampling)
        window_range = values.get("sde_window_range")
        if window_range is not None and sampling is not None:
            problems += _window_range_problems(window_range, sampling)
        return problems

    def all_prompts(self) -> list[str]:
        prompts = list(self.prompts)
        if self.prompts_file is not None:
            lines = Path(self.prompts_file).read_text().splitlines()
            prompts += [line.strip() for line in lines if line.strip()]
        return prompts


def _sampling_problems(sampling: SamplingParams) -> list[str]:
    problems = []
    if sampling.lora is not None:
        problems.append(f"sampling.lora must be null: the recipe samples with its own adapter {POLICY_ADAPTER!r}")
    if not (sampling.return_trajectory and sampling.output_type == "image"):
        problems.append("sampling.return_trajectory must be true and sampling.output_type 'image' for training")
    if sampling.num_samples * sampling.leaves_per_sample < 2:
        problems.append(
            f"sampling.num_samples (the group size) is {sampling.num_samples}; training compares the samples "
            "of a prompt with each other, so it needs at least 2 (or a tree: sampling.branch_steps)"
        )
    return problems


def _window_range_problems(window_range: tuple[int, int], sampling: SamplingParams) -> list[str]:
    if sampling.sde_window is None:
        return ["sde_window_range slides sampling.sde_window, which is null; set it (e.g. [0, 2] for 2 SDE steps)"]
    start, stop = window_range
    steps = sampling.num_inference_steps
    if not 0 <= start < stop <= steps:
        return [f"sde_window_range {list(window_range)} must satisfy 0 <= start < stop <= {steps} (the steps)"]
    size = sampling.sde_window[1] - sampling.sde_window[0]
    if stop - start < size:
        return [f"sde_window_range {list(window_range)} is narrower than sampling.sde_window's {size} steps"]
    return []


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


# update(policy, optimizer, rollout, generator) -> a dataclass of statistics for metrics.jsonl
UpdateFn = Callable[[LoraPolicy, torch.optim.Optimizer, RewardedRollout, torch.Generator], Any]


def train(
    config: TrainingConfig,
    update: UpdateFn,
    postfix: Callable[[Any], dict],
    old_policy: Callable[[LoraPolicy], OldPolicy] | None = None,
) -> dict:
    """Run the training loop; returns the summary written to summary.json. `postfix` picks the
    update statistics shown in the progress bar. `old_policy(policy)`, if given, makes the adapter
    the rollouts sample with instead of the policy's own (the evals still show the policy)."""
    check_model(config)  # before anything is written or loaded
    prompts = config.all_prompts()
    output_dir = Path(config.output_dir)
    resumed_from = resume_folder(config.resume, output_dir)
    resumed = read_resumable(resumed_from, to_dict(config)) if resumed_from is not None else None
    output_dir.mkdir(parents=True, exist_ok=True)
    model_path = config.model.resolve_path()
    config.engine.to_engine_config(model_path)  # checks the model folder (and engine settings) before any load
    config.engine.check_service()  # and a rollout service's answer (its key), before the policy loads
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    policy = LoraPolicy(
        model_path,
        config.lora.peft_config(),
        name=POLICY_ADAPTER,
        device=config.engine.device,
        dtype=getattr(torch, config.engine.dtype),
    )
    old = old_policy(policy) if old_policy is not None else None
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=config.optimizer.learning_rate, weight_decay=config.optimizer.weight_decay
    )
    params = dataclasses.replace(config.sampling, lora=POLICY_ADAPTER if old is None else old.name)
    prompt_order = PromptOrder(prompts, config.seed)
    edit_images = config.input_images.for_prompts(prompts)  # prompt -> its input images, or None
    history: list[dict] = []
    first_step, train_s_before = 0, 0.0
    if resumed is not None:
        state, optimizer_state = resumed
        policy.load(resumed_from / "lora")
        if old is not None:
            old.load(resumed_from / OLD_POLICY)
        optimizer.load_state_dict(optimizer_state)
        history, first_step, train_s_before = state.history, state.step, state.train_s
        drop_later_checkpoints(output_dir, state.step)
        logger.info("resuming from %s: step %d of %d", resumed_from, state.step, config.steps)
    started = time.perf_counter()
    with (
        open_loggers(config.logger, output_dir, to_dict(config), config.wandb, done=history) as loggers,
        open_reward_runner(
            config.reward,
            config.reward_workers,
            runner=config.reward_runner,
            devices=config.reward_devices,
            timeout_s=config.reward_timeout_s,
        ) as rewards,
        config.engine.open_engine(model_path) as engine,
    ):
        policy.check_same_base(engine)  # a server on another model folder answers here, not as a drift later
        # A resumed run re-pushes its adapter with the checkpoint's version, so the numbering (and
        # the check that samples carry the version last pushed) goes on, on a fresh server as on the same.
        version = _push(engine, policy, old, version=None if resumed is None else resumed[0].weight_version)
        if resumed is None:
            eval_start = _eval_samples(engine, config, prompts, rewards, edit_images)
            samples_start = save_samples(eval_start.outputs, config.grid_scale, output_dir / "samples_start")
            loggers.log_images(0, {"samples_start": samples_start})
            eval_reward_start = float(eval_start.rewards.mean())
        else:  # after the push: an engine in this process draws from torch's generator
            restore_rng(resumed[0].rng, prompt_order, generator)
            eval_reward_start = resumed[0].eval_reward_start
        steps = range(first_step, config.steps)
        bar = tqdm(steps, desc=config.recipe, unit="step", initial=first_step, total=config.steps)
        for step in bar:
            step_params = dataclasses.replace(params, seed=derive_seed(config.seed, step, 0, "rollout"))
            if config.sde_window_range is not None:
                window_rng = random.Random(derive_seed(config.seed, step, 0, "sde_window"))
                step_params = slide_window(step_params, config.sde_window_range, window_rng)
            taken = prompt_order.take(config.prompts_per_step)
            images = None if edit_images is None else [edit_images[prompt] for prompt in taken]
            rollout = generate_with_rewards(engine, taken, step_params, rewards, None, f"step{step}-", images)
            stale = {o.weight_version for o in rollout.outputs} - {version}
            if stale:
                raise RuntimeError(f"step {step}: samples carry weight versions {stale}, expected {version}")
            update_started = time.perf_counter()
            stats = update(policy, optimizer, rollout, generator)
            update_s = time.perf_counter() - update_started
            push_started = time.perf_counter()
            new_version = _push(engine, policy, old)
            if new_version <= version:
                raise RuntimeError(f"step {step}: the push returned weight version {new_version}, not above {version}")
            version = new_version
            record = _step_record(step, rollout, stats, version, update_s, time.perf_counter() - push_started)
            record["sde_window"] = list(step_params.sde_window) if step_params.sde_window is not None else None
            if step == 0:
                _log_first_ratio(record)
            history.append(record)
            loggers.log_scalars(step, record)
            bar.set_postfix(reward=f"{record['reward_mean']:.4f}", **postfix(stats))
            if config.checkpoint_every and ((step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps):
                state = TrainingState(
                    step=step + 1,
                    weight_version=version,
                    history=history,
                    eval_reward_start=eval_reward_start,
                    train_s=train_s_before + time.perf_counter() - started,
                    config=to_dict(config),
                    rng=rng_state(prompt_order, generator),
                )
                write_checkpoint(output_dir, state, policy, optimizer, config.keep_checkpoints, old_policy=old)
        eval_end = _eval_samples(engine, config, prompts, rewards, edit_images)
        # After `steps` updates: the x position that follows the last step's scalars.
        samples_end = save_samples(eval_end.outputs, config.grid_scale, output_dir / "samples_end")
        loggers.log_images(config.steps, {"samples_end": samples_end})
    train_s = train_s_before + time.perf_counter() - started

    plot_reward(history, output_dir / "reward.png", title=f"{config.recipe}: reward {reward_label(config.reward)}")
    if history and "log_ratio_by_step_max" in history[0]:  # GRPO's; DPO has no policy ratio
        plot_log_ratio(history, output_dir / "log_ratio.png", title=f"{config.recipe}: rollout/train agreement")
    lora_file = policy.save(output_dir / "lora")
    summary = _summary(config, history, eval_reward_start, eval_end, train_s, model_path, lora_file)
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


def _push(engine, policy: LoraPolicy, old: OldPolicy | None, version: int | None = None) -> int:
    """Push the policy's adapter (then the old policy's, when there is one); returns the weight
    version the next samples carry (`version`: a resumed run's)."""
    if old is None:
        return policy.push(engine, version=version)
    policy.push(engine)
    return old.push(engine, version=version)


def _eval_samples(
    engine, config: TrainingConfig, prompts: list[str], rewards: RewardRunner, edit_images: dict | None
) -> RewardedRollout:
    params = dataclasses.replace(
        config.sampling,
        lora=POLICY_ADAPTER,
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


def _log_first_ratio(record: dict) -> None:
    if "log_ratio_before_update" not in record:
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
    lora_file: Path,
) -> dict:
    rewards = [record["reward_mean"] for record in history]
    log_ratios = [record["log_ratio_before_update"] for record in history if "log_ratio_before_update" in record]
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
        "lora_file": str(lora_file),
    }
