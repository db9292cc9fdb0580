"""The trainer's ranks: who this process is among the data-parallel trainers, and the few
collectives the updates need.

Every rank runs the same update over the same view of the step (the same advantages, transitions,
minibatches and random draws: `rollout_shares`), computes the forwards and backwards of the samples
it holds, and sums the trainable parameters' gradients over the ranks before the optimizer step.
The losses are scaled by the whole minibatch's size, so the sum is the gradient one rank computes
over the whole minibatch, up to float32 summation order; every rank then takes the same optimizer
step and stays equal to the others without a parameter broadcast. An all-reduce of the gradients
rather than DDP: an update runs many forwards per optimizer step (micro-batches, a reference or old
policy's forward in between, a rank that holds none of a minibatch's samples), which DDP's
per-backward hooks and its need for every rank to run the same forwards make awkward; the LoRA's
gradients are a few MB, reduced once per optimizer step in one flat buffer.

One rank (`TrainerRanks()`) does no communication, so the updates run unchanged without
`torch.distributed`. Launched by torchrun (`torchrun --nproc-per-node N -m recipes.run CONFIG`),
`TrainerRanks.from_environment` joins the process group torchrun describes.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TrainerRanks:
    """This process's `rank` among `world_size` trainer ranks; one rank: no collectives."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(
                f"{self.world_size} trainer ranks need torch.distributed's process group: launch with torchrun "
                "(TrainerRanks.from_environment joins it)"
            )

    @classmethod
    def from_environment(cls, device: str, timeout_s: float = 1800.0, always_join: bool = False) -> TrainerRanks:
        """The ranks torchrun launched (its RANK and WORLD_SIZE variables), joined into the default
        process group (NCCL on a CUDA `device`, gloo on the CPU); one rank without them, in a
        process group of its own if `always_join` (FSDP needs one: `FullPolicy`). `timeout_s`: how
        long a collective waits for a rank that fell behind (a rollout included) before it fails."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1 and not always_join:
            return cls()
        if not dist.is_initialized():
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            timeout = datetime.timedelta(seconds=timeout_s)
            if world_size == 1:  # no rendezvous to make: a store in this process
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                dist.init_process_group(backend, timeout=timeout)
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes the run's files and talks to a shared engine."""
        return self.rank == 0

    def share(self, count: int) -> range:
        """This rank's contiguous share of `count` items (the first `count % world_size` ranks take
        one more), so the shares in rank order are the items in order."""
        base, extra = divmod(count, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` (picklable) on every rank."""
        if self.world_size == 1:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def scatter(self, values: list[Any] | None) -> Any:
        """Rank 0's `values[r]` (one per rank, picklable) on rank r; the others pass None."""
        if self.world_size == 1:
            return values[0]
        box: list[Any] = [None]
        dist.scatter_object_list(box, values if self.is_main else None, src=0)
        return box[0]

    def sum(self, value: float) -> float:
        """`value` summed over the ranks (in float64)."""
        return value if self.world_size == 1 else float(self._reduce(torch.tensor([value], dtype=torch.float64)))

    def max(self, value: float) -> float:
        """The largest of the ranks' `value`s."""
        if self.world_size == 1:
            return value
        return float(self._reduce(torch.tensor([value], dtype=torch.float64), dist.ReduceOp.MAX))

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Replace every parameter's gradient by its sum over the ranks, in one flat buffer per
        dtype; a rank that computed none for a parameter (it held no sample of the minibatch)
        counts zeros."""
        if self.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            by_dtype.setdefault(parameter.grad.dtype, []).append(parameter)
        for group in by_dtype.values():
            flat = torch.cat([parameter.grad.reshape(-1) for parameter in group])
            flat = self._reduce(flat)
            for parameter, summed in zip(group, flat.split([p.numel() for p in group]), strict=True):
                parameter.grad.copy_(summed.view_as(parameter.grad))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        # NCCL reduces CUDA tensors only; gloo CPU ones.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        moved = tensor.to(device) if device is not None else tensor
        dist.all_reduce(moved, op=op)
        return moved.to(tensor.device)
