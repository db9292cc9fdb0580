"""A torch.distributed broadcast group between a trainer (rank 0) and the engine's workers, for
weight updates from other processes or machines.

The group is a standalone `ProcessGroupGloo` (or NCCL) over its own TCPStore, so neither side's
default process group is touched: a trainer already using torch.distributed keeps its own.
Tensors travel in buckets of about `bucket_bytes`, each one flat byte buffer; both sides derive
the same buckets from the same (name, shape, dtype) list with `plan_buckets`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rollout.weights.state import TensorSpec


@dataclass(frozen=True)
class BroadcastEntry:
    name: str
    spec: TensorSpec

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


def connect(
    master_address: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """Join the group as `rank`; rank 0 hosts the store. Blocks until every rank has joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def plan_buckets(entries: list[BroadcastEntry], bucket_bytes: int) -> list[list[BroadcastEntry]]:
    """Consecutive entries grouped until a bucket holds at least `bucket_bytes`."""
    buckets: list[list[BroadcastEntry]] = [[]]
    size = 0
    for entry in entries:
        if buckets[-1] and size >= bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(entry)
        size += entry.nbytes
    return [bucket for bucket in buckets if bucket]


def send_bucket(group: dist.ProcessGroup, tensors: list[torch.Tensor], device: torch.device) -> None:
    """Rank 0: broadcast tensors packed into one flat byte buffer."""
    flat = torch.cat([t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    group.broadcast(flat, 0).wait()


def receive_bucket(group: dist.ProcessGroup, bucket: list[BroadcastEntry], device: torch.device) -> dict:
    """Other ranks: receive one bucket; returns name -> tensor (views of one fresh buffer)."""
    flat = torch.empty(sum(entry.nbytes for entry in bucket), dtype=torch.uint8, device=device)
    group.broadcast(flat, 0).wait()
    tensors, offset = {}, 0
    for entry in bucket:
        data = flat[offset : offset + entry.nbytes]
        tensors[entry.name] = data.view(entry.spec.dtype).reshape(entry.spec.shape)
        offset += entry.nbytes
    return tensors
