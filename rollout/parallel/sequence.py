"""Sequence parallel (Ulysses) inside one replica group, through diffusers' own context parallelism.

Each rank of a group holds the whole model and runs the same batch; diffusers' `enable_parallelism`
hooks split the transformer's token sequence across the group's ranks at its entry (the model's
`_cp_plan`), exchange heads for tokens around every attention (Ulysses all-to-all), and gather the
whole sequence again at its exit, so every rank ends the forward with the same full velocity and
takes the same sampler step with the same generators.

The group is its own `torch.distributed` world (the default process group of the worker process,
gloo on CPU; NCCL on CUDA, with gloo for CPU tensors) over a `FileStore` the executor names, laid
out as a device mesh of dims ("cfg", "ring", "ulysses") (`group_mesh`): with CFG parallel
(`rollout.parallel.cfg`) each half of the group is a Ulysses sub-group of its own, and diffusers
is given the mesh, so its all-to-alls stay inside the half. A trainer's weight broadcast group
(`rollout.weights.broadcast_group`) is a standalone group and does not touch it.

diffusers' "Ulysses anything" mode is used: it splits sequences of any length (a batch's text
length is its longest prompt's, an image's token count its size's), where the plain mode needs
every length divisible by the degree. It has no backward pass, which a rollout never needs; the
trainer re-scores on its own single-device copy.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupMember:
    """Where one worker sits in its replica group: what it needs to join the group's process group."""

    store_path: str  # the group's FileStore (one file per group, named by the executor)
    group: int  # the replica group's index
    local_rank: int  # this worker's rank inside the group; 0 hands back the group's outputs
    size: int  # ranks per group (cfg_parallel x sequence_parallel)
    timeout_s: float  # how long joining and every collective may wait for the group's other ranks

    @property
    def replies(self) -> bool:
        """Whether this rank hands back the group's outputs (the others run the same step)."""
        return self.local_rank == 0


def join_group(member: GroupMember, device: str) -> dist.Store:
    """Make the group this process's default process group (gloo on CPU; on CUDA, NCCL for CUDA
    tensors and gloo for CPU ones); blocks until every rank of the group has joined. Returns the
    group's store (where its ranks report failed steps, `rollout.parallel.group_failures`)."""
    if dist.is_initialized():
        raise RuntimeError(
            "sequence parallel needs the worker's default torch.distributed process group for its replica "
            "group, but one is already initialized in this worker process"
        )
    # diffusers' Ulysses attention for any length gathers each rank's sequence length at every
    # attention, on the CPU where the group has a CPU backend, else on the GPU followed by `.item()`:
    # a wait for the device's queue inside every forward. The gloo half keeps that on the host.
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    os.makedirs(os.path.dirname(member.store_path), exist_ok=True)  # on another node than the engine's (Ray)
    store = dist.FileStore(member.store_path, member.size)
    dist.init_process_group(
        backend,
        store=store,
        rank=member.local_rank,
        world_size=member.size,
        timeout=datetime.timedelta(seconds=member.timeout_s),
    )
    logger.info("joined replica group %d as rank %d of %d (%s)", member.group, member.local_rank, member.size, backend)
    return store


MESH_DIMS = ("cfg", "ring", "ulysses")  # ring attention is not offered: its degree is 1


def group_mesh(cfg_degree: int, ulysses_degree: int, device: str) -> DeviceMesh:
    """The replica group's device mesh over this process's default group (`join_group` first):
    rank = cfg coordinate x `ulysses_degree` + ulysses coordinate, so the group's first
    `ulysses_degree` ranks are the conditional half. Every rank of the group must call it."""
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    return init_device_mesh(device_type, (cfg_degree, 1, ulysses_degree), mesh_dim_names=MESH_DIMS)


# The pipeline components that predict velocities (`PipelineAdapter.denoisers`): Wan 2.2 has two.
DENOISER_COMPONENTS = ("transformer", "transformer_2")


def missing_plans(denoisers: dict[str, type]) -> list[str]:
    """The denoiser classes (as "component (Class)") that have no context-parallel plan."""
    return [
        f"{name} ({cls.__name__})"
        for name, cls in denoisers.items()
        if cls._cp_plan is None  # every diffusers ModelMixin has one: None where diffusers has no plan
    ]


def plan_problems(model_index: dict, degree: int) -> list[str]:
    """What stops `sequence_parallel=degree` on the pipeline of `model_index` (its model_index.json),
    found before any worker loads it: a denoiser whose diffusers class has no context-parallel plan."""
    if degree == 1:
        return []
    import diffusers

    denoisers = {
        name: getattr(diffusers, model_index[name][1])
        for name in DENOISER_COMPONENTS
        if isinstance(model_index.get(name), list) and model_index[name][1] is not None
    }
    return _plan_refusal(missing_plans(denoisers), degree, model_index["_class_name"])


def _plan_refusal(missing: list[str], degree: int, pipeline_class: str) -> list[str]:
    if not missing:
        return []
    return [
        f"sequence_parallel={degree} needs a context-parallel plan in diffusers, and {pipeline_class}'s "
        f"{', '.join(missing)} has none; run this model with sequence_parallel=1 (families with a plan: "
        "FLUX.1, FLUX.2, Qwen-Image, Wan)"
    ]


def enable_sequence_parallel(denoisers: dict[str, nn.Module], mesh: DeviceMesh, pipeline_class: str) -> None:
    """Shard the sequence of every denoiser across the ranks of this rank's "ulysses" sub-mesh of
    `mesh` (`group_mesh`). A denoiser whose diffusers class has no context-parallel plan is refused."""
    from diffusers import ContextParallelConfig

    degree = mesh["ulysses"].size()
    refusal = _plan_refusal(missing_plans({name: type(m) for name, m in denoisers.items()}), degree, pipeline_class)
    if refusal:
        raise ValueError(refusal[0])
    with _one_device_per_cpu_rank():
        for module in denoisers.values():
            # diffusers shards over the ("ring", "ulysses") slice of the mesh that holds this rank.
            config = ContextParallelConfig(ulysses_degree=degree, ulysses_anything=True, mesh=mesh)
            module.enable_parallelism(config=config)


def sequence_boundaries(denoiser: nn.Module) -> set[str]:
    """Names of the denoiser's modules where diffusers' context parallelism splits the token
    sequence (at their input) or gathers it (at their output): the modules its hooks sit on
    (`enable_parallelism` puts them there, from the class's `_cp_plan`). A LoRA layer wrapping one
    would run its own path on the other side of the hook from its base layer (FLUX.1's `proj_out`:
    the base output gathered, the adapter's from one rank's tokens), so `LoraManager` refuses them."""
    from diffusers.hooks.context_parallel import ContextParallelGatherHook, ContextParallelSplitHook
    from diffusers.hooks.hooks import HookRegistry

    names = set()
    for name, module in denoiser.named_modules():
        registry = module.__dict__.get("_diffusers_hook")  # set on the modules diffusers hooks, only there
        if isinstance(registry, HookRegistry) and any(
            isinstance(hook, ContextParallelGatherHook | ContextParallelSplitHook) for hook in registry.hooks.values()
        ):
            names.add(name)
    return names


@contextlib.contextmanager
def _one_device_per_cpu_rank() -> Iterator[None]:
    """diffusers places a rank on device `rank % torch.accelerator.device_count()`, which is a
    division by zero on a machine without an accelerator; there, every rank's device is the CPU, so
    the count answers 1 while parallelism is enabled (and only then)."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count
