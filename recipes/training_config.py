"""The config of the training recipes (GRPO, DPO, DiffusionNFT): the sections they share and
`TrainingConfig`, which each recipe's `Config` extends with its update's settings.

It imports no torch, so that `python -m recipes.run` checks a config at once; the training loop
(`recipes.training`) is imported when a recipe runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recipes.config import EngineSection, ModelSection, RecipeConfig, option
from recipes.edit_images import InputImagesSection
from recipes.loggers import WandbSection, logger_problems
from rollout import SamplingParams

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


PLACEMENTS = ("colocated", "separate")
POLICIES = ("lora", "full")


@dataclass(kw_only=True)
class TrainerSection:
    """How the trainer runs and what it keeps in memory: its ranks are the processes torchrun starts
    (`torchrun --nproc-per-node N -m recipes.run CONFIG`), and `--plan` counts what each device
    holds (docs/training.md)."""

    placement: str = option(
        "colocated",
        "colocated: every trainer rank hosts its own engine (the engine section's, on the rank's device), samples "
        "its share of each step's prompts and loads each new LoRA into it; separate: rank 0 alone opens the engine "
        "(its mp or ray workers on other devices, or engine.url), samples the whole step and hands each rank its "
        "share, and pushes one adapter per step. One rank: the same either way",
    )
    share_base: bool = option(
        True,
        "with an engine in the trainer's process (executor uni), the trainer's policy shares the engine's frozen "
        "base weights (one copy of the base per device; LoraPolicy.sharing_base); false: the trainer loads its own "
        "copy of the denoisers. The run is the same either way; other executors and engine.url ignore it",
    )
    gradient_checkpointing: bool = option(
        False,
        "recompute each transformer block's activations in the backward instead of keeping them from the forward: "
        "the same gradients, a lower memory peak per micro-batch, about one more forward of the blocks in time",
    )
    device_memory_gib: float | None = option(
        None,
        "memory of each device the memory plan checks the fit against; null: the total of engine.device "
        "when it is a CUDA device torch sees here, else no fit check",
    )
    engine_sleep: int = option(
        0,
        "0: a colocated rank's engine keeps its weights on the device while the trainer updates; 1 or 2: it sleeps "
        "at that level through each update and wakes for the push, so training has its weights' memory (the memory "
        "plan counts the larger phase). 1: the weights wait in host memory; 2: they are dropped and reloaded from "
        "the model folder on waking. Colocated only, and not while the policy shares the engine's base",
    )

    def __post_init__(self) -> None:
        problems = []
        if self.placement not in PLACEMENTS:
            problems.append(f"placement must be one of {list(PLACEMENTS)}, got {self.placement!r}")
        if self.engine_sleep not in (0, 1, 2):
            problems.append(f"engine_sleep must be 0, 1 or 2, got {self.engine_sleep}")
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            problems.append(f"device_memory_gib must be > 0 (or null), got {self.device_memory_gib}")
        if problems:
            raise ValueError("; ".join(problems))


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
    policy: str = option(
        "lora",
        "what the trainer trains: lora (an adapter, the lora section; the engine's base stays) or full (every weight "
        "of the denoisers, sharded with FSDP2 over the trainer ranks and pushed to the engine after every step; "
        "docs/training.md)",
    )
    lora: LoraSection = option(factory=LoraSection)
    optimizer: OptimizerSection = option(factory=OptimizerSection)
    trainer: TrainerSection = option(factory=TrainerSection)
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
        prompts_file = values.get("prompts_file")
        if prompts_file is not None and not Path(prompts_file).is_file():
            problems.append(f"prompts_file {prompts_file!r} does not exist")
        if values.get("prompts") == [] and "prompts_file" in values and prompts_file is None:
            problems.append("prompts is empty and no prompts_file is given; give at least one prompt")
        if values.get("policy") not in (None, *POLICIES):
            problems.append(f"policy must be one of {list(POLICIES)}, got {values['policy']!r}")
        engine = values.get("engine")
        if values.get("policy") == "full" and engine is not None and engine.compile != "off":
            problems.append(
                "policy full trains the eager denoisers (FSDP's units are the blocks compile=blocks compiles): "
                "set engine.compile: off"
            )
        problems += _engine_sleep_problems(values)
        for name in ("prompts_per_step", "steps", "grid_scale", "keep_checkpoints"):
            if values.get(name, 1) < 1:
                problems.append(f"{name} must be >= 1, got {values[name]}")
        if values.get("checkpoint_every", 0) < 0:
            problems.append(f"checkpoint_every must be >= 0 (0: no checkpoints), got {values['checkpoint_every']}")
        sampling = values.get("sampling")
        if sampling is not None:
            problems += _sampling_problems(sampling)
        window_range = values.get("sde_window_range")
        if window_range is not None and sampling is not None:
            problems += _window_range_problems(window_range, sampling)
        if sampling is not None:
            problems += cls.sampling_problems(sampling)
        return problems

    @classmethod
    def sampling_problems(cls, sampling: SamplingParams) -> list[str]:
        """What the recipe's algorithm needs of the rollouts' `sampling` beside what every training
        recipe needs (GRPO: log-probs; DiffusionNFT: deterministic rollouts); nothing by default."""
        return []

    def import_problems(self) -> list[str]:
        """The engine's classes, the rewards (their classes and settings), where reward workers run
        and what `resume` names: checks that import the rewards, torch and the checkpoints."""
        from recipes.checkpoint import resume_problems
        from trainers_adapters.rewards.placement import placement_problems
        from trainers_adapters.rewards.spec import reward_problems

        engine = self.engine.class_problems()
        problems = [f"engine: {'; '.join(engine)}"] if engine else []
        config = reward_problems(self.reward)
        config += placement_problems(
            self.reward_workers, self.reward_runner, self.reward_devices, self.reward_timeout_s, self.reward
        )
        config += resume_problems(self.resume, self.output_dir)
        return problems + [f"config: {problem}" for problem in config]

    def fit_problems(self) -> list[str]:
        """Whether the memory plan fits each device (each problem prefixed "config: "), where the
        device's memory is known (set, or a CUDA device torch sees) and the model folder is here: it
        builds meta modules and runs one micro-batch on fake tensors (seconds), so only then."""
        from recipes.memory_plan import device_capacity, memory_plan

        if device_capacity(self)[0] is None:
            return []
        if self.model.path != "tiny" and not Path(self.model.path).is_dir():
            return []  # checked where the model is; model.path's own check says it is missing
        return [f"config: {problem}" for problem in memory_plan(self).problems()]

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


def _engine_sleep_problems(values: dict) -> list[str]:
    """`trainer.engine_sleep` sleeps the rank's own engine, between its rollout and its push."""
    trainer, engine = values.get("trainer"), values.get("engine")
    if trainer is None or not trainer.engine_sleep:
        return []
    problems = []
    if trainer.placement != "colocated" or (engine is not None and engine.url is not None):
        problems.append(
            "trainer.engine_sleep sleeps each rank's own engine (trainer.placement colocated, no engine.url): "
            "set trainer.engine_sleep: 0"
        )
    shared = trainer.share_base and engine is not None and engine.executor == "uni"
    if values.get("policy", "lora") == "lora" and shared:
        problems.append(
            "trainer.engine_sleep would free the base weights the LoRA policy shares with the engine "
            "(trainer.share_base): set trainer.share_base: false (the trainer loads its own copy) or engine_sleep: 0"
        )
    asynchronous = values.get("asynchronous")
    if asynchronous is not None and asynchronous.max_staleness is not None:
        problems.append(
            "asynchronous training samples while the trainer updates, so the engine cannot sleep then: "
            "set trainer.engine_sleep: 0"
        )
    return problems
