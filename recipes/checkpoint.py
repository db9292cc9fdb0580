"""Checkpoints of a training run, and finding the one to resume from.

A checkpoint is one folder `output_dir/checkpoints/step-000010/` (10: the steps done) holding
`lora/` (the adapter, as `LoraPolicy.save` writes it), `optimizer.pt` (the optimizer's
state_dict; the recipes have no LR schedule, so that is all the optimizer state there is),
`rng.pt` (the states of every generator the loop draws from) and `state.json` (the step, the
weight version of the last push, the metrics so far, the eval reward at the start, the training
time so far and the config the run had); a DiffusionNFT run adds `old_policy/` (its old adapter
and the optimizer steps its EMA schedule has counted, as `OldPolicy.save` writes them); an
asynchronous run adds `behaviour/` (the earlier adapters the rollouts of the next steps sample with,
`<updates>.safetensors` each, `recipes.async_rollouts`).

Why one folder per checkpoint, published by a rename: a checkpoint is written whole into a hidden
sibling (`.step-000010.partial`), every file and the folder are fsynced, and only then is it
renamed to its name, an atomic step on one file system. A crash before the rename leaves the
earlier checkpoints as they were (the partial folder is hidden, and the next write removes it);
the older ones are deleted only after the new one is in place, keeping the latest
`keep_checkpoints`. Only our own files are read back, with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.old_policy import OldPolicy

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # the folder under output_dir
STATE_FILE = "state.json"  # written last; a folder without it is not a checkpoint
OLD_POLICY = "old_policy"  # a decoupled algorithm's old adapter (DiffusionNFT)
BEHAVIOUR = "behaviour"  # an asynchronous run's earlier adapters, by the updates they had
_STEP_FOLDER = re.compile(r"step-(\d{6,})")
FORMAT = 1

# Config keys a resume may change: the run's length, where its engine runs and its files and
# metrics go, checkpointing itself, and gradient checkpointing (the same gradients, less memory: a
# run that ran out of memory resumes with it on). Any other difference would make the resumed run
# another run.
RESUMABLE_KEYS = frozenset(
    {
        "steps",
        "output_dir",
        "resume",
        "checkpoint_every",
        "keep_checkpoints",
        "grid_scale",
        "logger",
        "wandb.project",
        "wandb.entity",
        "wandb.name",
        "wandb.mode",
        "model.tiny_cache_dir",
        "engine.url",
        "engine.executor",
        "engine.num_workers",
        "engine.max_batch_size",
        "trainer.gradient_checkpointing",
    }
)


@dataclass
class TrainingState:
    """What a checkpoint holds besides the adapter and the optimizer state."""

    step: int  # steps done: the resumed run starts with this step index
    weight_version: int  # the version of the last push, which the next rollout's samples carry
    history: list[dict]  # the metrics.jsonl records of the steps done
    eval_reward_start: float  # the mean reward of the eval samples before training
    train_s: float  # training time so far, summed over the run's segments
    config: dict  # `to_dict` of the config the run had
    rng: dict[str, Any]  # generator states (tensors, tuples): see `recipes.randomness.rng_state`


def checkpoint_folder(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step-{step:06d}"


def write_checkpoint(
    output_dir: str | Path,
    state: TrainingState,
    policy: LoraPolicy,
    optimizer: torch.optim.Optimizer,
    keep: int = 1,
    old_policy: OldPolicy | None = None,
    behaviour: dict[int, dict[str, torch.Tensor]] | None = None,
    main: bool = True,
) -> Path | None:
    """Write `state`, the policy's adapter (or weights), the optimizer's state (and the old
    policy, and the behaviour adapters by the updates they had, if any) as the checkpoint of
    `state.step`, atomically (see the module docstring), then delete all but the latest `keep`.
    A sharded policy's ranks (`FullPolicy`) all call this: each gathers its shards, and only the
    `main` one writes (the others get None)."""
    optimizer_state = policy.optimizer_state(optimizer)  # gathered whole (a sharded policy's)
    if not main:
        policy.save(None, write=False)
        return None
    parent = Path(output_dir) / CHECKPOINTS
    parent.mkdir(parents=True, exist_ok=True)
    for leftover in parent.glob(".step-*"):  # a write or replace that a crash interrupted
        shutil.rmtree(leftover)
    final = checkpoint_folder(output_dir, state.step)
    partial = parent / f".{final.name}.partial"
    partial.mkdir()
    policy.save(partial / policy.saved_as)
    torch.save(optimizer_state, partial / "optimizer.pt")
    if old_policy is not None:
        old_policy.save(partial / OLD_POLICY)
    if behaviour:
        (partial / BEHAVIOUR).mkdir()
        for index, tensors in behaviour.items():
            contiguous = {key: tensor.contiguous() for key, tensor in tensors.items()}
            save_file(contiguous, partial / BEHAVIOUR / f"{index}.safetensors")
    torch.save(state.rng, partial / "rng.pt")
    saved = {key: value for key, value in asdict(state).items() if key != "rng"}
    (partial / STATE_FILE).write_text(json.dumps({"format": FORMAT, **saved}, indent=1) + "\n")
    _fsync_tree(partial)
    replaced = None
    if final.exists():  # the same step written again (a run resumed from an earlier checkpoint)
        replaced = parent / f".{final.name}.replaced"
        os.rename(final, replaced)
    os.rename(partial, final)
    _fsync(parent)
    if replaced is not None:
        shutil.rmtree(replaced)
    for older in checkpoints(output_dir)[:-keep]:
        shutil.rmtree(older)
    logger.info("checkpoint of step %d written to %s", state.step, final)
    return final


def read_checkpoint(folder: str | Path) -> tuple[TrainingState, dict]:
    """(the state, the optimizer's state_dict) of the checkpoint in `folder`; its adapter is
    `folder / policy.saved_as`, for the policy's `load`."""
    folder = Path(folder)
    saved = json.loads((folder / STATE_FILE).read_text())
    written_format = saved.pop("format")
    if written_format != FORMAT:
        raise ValueError(f"checkpoint {str(folder)!r} has format {written_format}, this code reads {FORMAT}")
    rng = torch.load(folder / "rng.pt", weights_only=True)
    optimizer_state = torch.load(folder / "optimizer.pt", weights_only=True)
    return TrainingState(**saved, rng=rng), optimizer_state


def read_behaviour(folder: str | Path) -> dict[int, dict[str, torch.Tensor]]:
    """The behaviour adapters an asynchronous run's checkpoint in `folder` keeps (none: {})."""
    found = Path(folder) / BEHAVIOUR
    if not found.is_dir():
        return {}
    return {int(path.stem): load_file(path) for path in sorted(found.glob("*.safetensors"))}


def read_resumable(folder: Path, config: dict) -> tuple[TrainingState, dict]:
    """`read_checkpoint(folder)` for a run with `config` (`to_dict` of it), refused with a
    ValueError naming the keys if the run it continues was another run, or if it is past `steps`."""
    state, optimizer_state = read_checkpoint(folder)
    differences = config_differences(state.config, config)
    if differences:
        raise ValueError(
            f"cannot resume from {str(folder)!r}: the config differs in what changes the run: "
            + "; ".join(differences)
            + ". Resume with the checkpoint's values (only steps, where the engine runs and where files "
            "and metrics go may change)"
        )
    if config["steps"] < state.step:
        raise ValueError(
            f"cannot resume from {str(folder)!r}: it is at step {state.step}, past steps={config['steps']}; "
            f"set steps >= {state.step}"
        )
    return state, optimizer_state


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints under `output_dir`, oldest first."""
    parent = Path(output_dir) / CHECKPOINTS
    if not parent.is_dir():
        return []
    found = [
        (int(match[1]), path)
        for path in parent.iterdir()
        if (match := _STEP_FOLDER.fullmatch(path.name)) and (path / STATE_FILE).is_file()
    ]
    return [path for _, path in sorted(found)]


def resume_folder(resume: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint a run with `resume` continues from: None for a new run (`resume` null, or
    `auto` with no checkpoint yet); `auto`: the latest in `output_dir`; a path: that checkpoint, or
    the latest in that output folder. Raises ValueError where there is none to continue."""
    problems = resume_problems(resume, output_dir)
    if problems:
        raise ValueError("; ".join(problems))
    if resume is None:
        return None
    if resume == "auto":
        found = checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    return path if (path / STATE_FILE).is_file() else checkpoints(path)[-1]


def resume_problems(resume: str | None, output_dir: str | Path) -> list[str]:
    """What keeps a run with `resume` from starting: a path holding no checkpoint, or a new run
    in an output_dir whose checkpoints it would mix with its own."""
    if resume is None:
        found = checkpoints(output_dir)
        if not found:
            return []
        return [
            f"output_dir {str(output_dir)!r} holds checkpoints of an earlier run (the latest {found[-1].name}); "
            f"continue it with --resume {output_dir} (or resume: auto), or choose another output_dir"
        ]
    if resume == "auto":
        return []
    path = Path(resume)
    if (path / STATE_FILE).is_file() or checkpoints(path):
        return []
    return [
        f"resume {resume!r} is neither a checkpoint folder (with {STATE_FILE}) nor an output_dir with "
        f"{CHECKPOINTS}/step-*; name one of those, or use resume: auto"
    ]


def drop_later_checkpoints(output_dir: str | Path, step: int) -> None:
    """Delete the checkpoints in `output_dir` past `step`: a run resumed from an earlier one
    replaces what the interrupted run did after it."""
    for path in checkpoints(output_dir):
        if int(_STEP_FOLDER.fullmatch(path.name)[1]) > step:
            logger.warning("deleting checkpoint %s: the run resumes from step %d, before it", path, step)
            shutil.rmtree(path)


def config_differences(saved: dict, current: dict) -> list[str]:
    """The keys (dotted) whose values differ between two `to_dict` configs, but for those a resume
    may change (`RESUMABLE_KEYS`), each with both values."""
    before, now = _flatten(saved), _flatten(current)
    return [
        f"{key}: {before.get(key)!r} in the checkpoint, {now.get(key)!r} now"
        for key in sorted(before.keys() | now.keys())
        if key not in RESUMABLE_KEYS and before.get(key) != now.get(key)
    ]


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        _fsync(path)
    _fsync(folder)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
