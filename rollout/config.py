"""Engine configuration: plain data, whose values are checked when it is made.

What needs the file system or imports (the model folder, the executor and worker extension classes,
the executor's own rules) is checked by `rollout.engine.config_check` when an engine is built, before any
worker starts, so a typo still fails before any model loads. This module imports no torch (a
recipe checks its `engine` section with it); `torch_dtype` imports it when asked.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from rollout.request_limits import RequestLimits
from rollout.settings import setting

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # the names of torch's dtypes a model may be loaded in
MERGE_LORA_CHOICES = ("auto", "always", "never")
COMPILE_CHOICES = ("off", "blocks")  # rollout.pipelines.compiled_blocks compiles "blocks"
CFG_PARALLEL_CHOICES = (1, 2)
# The dtypes merge_lora="auto" merges in. A merged delta rounded into bfloat16 (8 bits of mantissa)
# or float16 (11) weights moves the velocity enough that re-scoring by the trainer's unmerged copy
# misses |log-ratio| < 1e-5: measured 7.9e-4 and 1.4e-4 on the tiny SD3 (float32: 2.4e-7; see
# docs/hot_swap.md, "Merged LoRA for rollouts").
MERGED_LORA_DTYPES = ("float32",)


@dataclass
class EngineConfig:
    """How to build a `RolloutEngine`: the model folder, where its workers run, and the bounds the
    engine puts on calls and requests. Each field's meaning, unit and choices are its `setting` help
    (`rollout.settings.setting_help`), which the server's flags and the recipes' `engine` section
    show as they are."""

    model: str = setting(help="local diffusers pipeline folder (nothing is downloaded)")
    executor: str | type = setting(
        "uni",
        "where the workers run: 'uni' (in this process), 'mp' (worker processes), 'ray' (Ray actors), or the "
        "dotted path 'pkg.module.MyExecutor' of an executors.Executor subclass (in Python also the class)",
    )
    num_workers: int = setting(
        1,
        "worker ranks: replicas (data parallel) x ranks per replica (cfg_parallel x sequence_parallel); 'uni' runs "
        "exactly one",
    )
    sequence_parallel: int = setting(
        1,
        "ranks per replica that share one sample's forward (Ulysses sequence parallel, through diffusers' context "
        "parallelism: FLUX.1, FLUX.2, Qwen-Image, Wan); num_workers must be a multiple of it ('mp', 'ray')",
    )
    cfg_parallel: int = setting(
        1,
        "1 or 2: with 2, a replica's ranks split in two halves, the conditional rows of classifier-free guidance "
        "on one and the unconditional rows on the other, at the same time (each half sequence_parallel ranks); "
        "num_workers must be a multiple of cfg_parallel x sequence_parallel ('mp', 'ray')",
    )
    worker_extension_cls: str | type | None = setting(
        None,
        "dotted path (in Python also the class) of a class whose methods become worker functions, callable by "
        "name through collective_rpc (a server's /collective_rpc)",
    )
    device: str = setting("cpu", "'cpu', 'cuda' or 'cuda:N'")
    dtype: str = setting("float32", "model weights dtype: float32, bfloat16 or float16 (trajectories stay float32)")
    max_batch_size: int = setting(16, "most samples one worker denoises in one forward pass")
    merge_lora: str = setting(
        "auto",
        "run a forward's LoRA adapter merged into the base weights (the base model's speed; one more copy of the "
        "targeted weights in memory): 'always', 'never', or 'auto' (merged for float32; unmerged for bfloat16 and "
        "float16, whose rounding of the merged weights breaks the |log-ratio| < 1e-5 re-scoring contract)",
    )
    attention_backend: str | None = setting(
        None,
        "the kernel of every attention in the denoisers: one of diffusers' attention dispatcher names "
        "(diffusers.models.attention_dispatch.AttentionBackendName: 'native', '_native_math', 'flash', "
        "'_flash_3', 'sage', ...) that the installed packages and the device can run, checked before any worker "
        "starts; None: diffusers' default (torch's scaled_dot_product_attention). A trainer re-scores with the "
        "same backend (load_adapter's and LoraPolicy's attention_backend)",
    )
    compile: str = setting(
        "off",
        "'off' (eager) or 'blocks': each denoiser's repeated transformer blocks run torch.compile'd (diffusers' "
        "regional compilation; the batch dimension dynamic), compiled at a worker's first forwards; weight "
        "updates, merged LoRA adapters and sleep/wake run on without a recompile (see docs/engine.md)",
    )
    threads_per_worker: int | None = setting(
        None, "torch CPU threads of each worker process ('mp', 'ray'); None divides the machine's cores among them"
    )
    rpc_timeout_s: float = setting(300.0, "default timeout of collective_rpc (a worker function), in seconds")
    step_timeout_s: float = setting(
        600.0,
        "the longest one engine step may go without progress, in seconds: a step whose workers' models keep "
        "running (every transformer, text-encoder and VAE block counts) is waited for however long it takes; "
        "one with no block started for this long is hung, and the engine stops. A custom executor that "
        "reports no progress (no `_progress`) bounds the whole step by it",
    )
    startup_timeout_s: float = setting(600.0, "time every worker has to load the model, in seconds")
    ray_placement_strategy: str = setting(
        "PACK", "how executor 'ray' places its workers: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"
    )
    request_limits: RequestLimits = setting(
        factory=RequestLimits,
        help="what one request may ask for at most, checked at admission (see RequestLimits)",
    )

    def __post_init__(self) -> None:
        problems = value_problems(self)
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

    @classmethod
    def described(cls, settings: dict) -> EngineConfig:
        """A config as a rollout server reports it (`dataclasses.asdict` of its own): its model
        folder and classes are on the server's machine, and are named here by their paths."""
        known = {f.name for f in fields(cls)}
        settings = {name: value for name, value in settings.items() if name in known}
        if isinstance(settings.get("request_limits"), dict):
            settings["request_limits"] = RequestLimits(**settings["request_limits"])
        return cls(**settings)

    @property
    def ranks_per_replica(self) -> int:
        """Worker ranks that run one replica's batches together (one sample's forward spans them):
        `cfg_parallel` halves of `sequence_parallel` ranks each."""
        return self.cfg_parallel * self.sequence_parallel

    @property
    def num_replicas(self) -> int:
        """Replica groups the scheduler balances batches over: `num_workers // ranks_per_replica`."""
        return self.num_workers // self.ranks_per_replica

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def merges_lora(self) -> bool:
        """Whether workers run LoRA adapters merged (`merge_lora`, with 'auto' decided by `dtype`)."""
        if self.merge_lora == "auto":
            return self.dtype in MERGED_LORA_DTYPES
        return self.merge_lora == "always"


def value_problems(config: Any) -> list[str]:
    """What is wrong with the values of `config` (an `EngineConfig`, or any object with its
    attributes), without reading files or importing classes."""
    problems = []
    if config.dtype not in DTYPES:
        problems.append(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
    if not isinstance(config.num_workers, int) or config.num_workers < 1:
        problems.append(f"num_workers must be an integer >= 1, got {config.num_workers!r}")
    sequence_ok = isinstance(config.sequence_parallel, int) and config.sequence_parallel >= 1
    if not sequence_ok:
        problems.append(f"sequence_parallel must be an integer >= 1, got {config.sequence_parallel!r}")
    cfg_ok = type(config.cfg_parallel) is int and config.cfg_parallel in CFG_PARALLEL_CHOICES
    if not cfg_ok:
        problems.append(
            f"cfg_parallel must be 1 or 2 (2: the conditional and the unconditional pass of classifier-free "
            f"guidance on two halves of a replica), got {config.cfg_parallel!r}"
        )
    degree = config.cfg_parallel * config.sequence_parallel if sequence_ok and cfg_ok else 1
    if isinstance(config.num_workers, int) and config.num_workers % degree:
        problems.append(_layout_problem(config.num_workers, config.cfg_parallel, config.sequence_parallel))
    if config.merge_lora not in MERGE_LORA_CHOICES:
        problems.append(f"merge_lora must be one of {', '.join(MERGE_LORA_CHOICES)}, got {config.merge_lora!r}")
    if config.compile not in COMPILE_CHOICES:
        problems.append(
            f"compile must be one of {', '.join(COMPILE_CHOICES)} ('blocks': the denoisers' repeated transformer "
            f"blocks compiled), got {config.compile!r}"
        )
    elif refusal := compiled_attention_refusal(config.compile, config.attention_backend):
        problems.append(refusal)
    elif config.compile == "blocks" and sequence_ok and config.sequence_parallel > 1:
        # diffusers' "Ulysses anything" attention (rollout.parallel.sequence) gathers every rank's
        # sequence length with a collective at each attention, which torch.compile cannot trace:
        # every request would fail at its first forward.
        problems.append(
            f"compile='blocks' cannot run with sequence_parallel={config.sequence_parallel}: the sequence-parallel "
            "attention exchanges each rank's sequence length at every attention, which torch.compile cannot "
            "trace; use compile='off' with sequence_parallel, or sequence_parallel=1 with compile='blocks' "
            "(cfg_parallel=2 and data-parallel workers compile)"
        )
    if not isinstance(config.max_batch_size, int) or config.max_batch_size < 1:
        problems.append(f"max_batch_size must be an integer >= 1, got {config.max_batch_size!r}")
    if config.threads_per_worker is not None and (
        not isinstance(config.threads_per_worker, int) or config.threads_per_worker < 1
    ):
        problems.append(f"threads_per_worker must be an integer >= 1 or None, got {config.threads_per_worker!r}")
    for name in ("rpc_timeout_s", "step_timeout_s", "startup_timeout_s"):
        if getattr(config, name) <= 0:
            problems.append(f"{name} must be > 0 seconds, got {getattr(config, name)}")
    if config.attention_backend is not None and (
        not isinstance(config.attention_backend, str) or not config.attention_backend
    ):
        problems.append(
            f"attention_backend must be None or the name of one of diffusers' attention backends, "
            f"got {config.attention_backend!r}"
        )
    if not (config.device == "cpu" or config.device.startswith("cuda")):
        problems.append(f"device must be 'cpu' or 'cuda[:N]', got {config.device!r}")
    return problems


# Attention backends torch cannot compile inside the blocks. Flex attention, measured on the CPU
# (torch 2.13, diffusers 0.42): inductor fails to lower it in Wan's, Z-Image's and LTX-2's blocks,
# and FLUX.2 [klein]'s compiled flex attention differs from its eager one by 6.7e-2.
UNCOMPILED_ATTENTION_BACKENDS = ("flex",)


def compiled_attention_refusal(compile: str, attention_backend: str | None) -> str | None:
    """Why `compile` cannot run with `attention_backend` (the engine's and a trainer's copy alike), or None."""
    if compile != "blocks" or attention_backend not in UNCOMPILED_ATTENTION_BACKENDS:
        return None
    return (
        f"compile='blocks' cannot run with attention_backend={attention_backend!r}: torch does not compile "
        "diffusers' flex attention inside the blocks (it fails to lower in Wan, Z-Image and LTX-2, and differs "
        "from eager by 6.7e-2 in FLUX.2 [klein]); use compile='blocks' with another backend ('native', or a "
        "flash backend on a GPU), or compile='off' with flex"
    )


def settings_problems(**settings) -> list[str]:
    """`value_problems` of `EngineConfig(model=..., **settings)`, for settings checked before their
    model exists (a recipe builds `tiny` only when it runs); nothing is read or imported."""
    return value_problems(SimpleNamespace(**(vars(EngineConfig(model="")) | settings)))


def _layout_problem(num_workers: int, cfg: int, sequence: int) -> str:
    """Why `num_workers` ranks do not make whole replicas of `cfg` x `sequence` ranks."""
    degree = cfg * sequence
    if cfg == 1:
        spans = f"sequence_parallel={sequence} ranks"
    elif sequence == 1:
        spans = f"cfg_parallel={cfg} ranks"
    else:
        spans = f"cfg_parallel={cfg} x sequence_parallel={sequence} = {degree} ranks"
    return (
        f"num_workers={num_workers} is not replicas x ranks per replica: each replica spans {spans}, so "
        f"num_workers must be a multiple of {degree} (e.g. {degree} for one replica, {2 * degree} for two)"
    )
