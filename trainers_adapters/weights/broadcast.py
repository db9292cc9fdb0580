"""Trainer side of the broadcast group: join as rank 0 and send a module's weights in buckets.

    broadcaster = WeightBroadcaster("127.0.0.1", 29500, world_size=1 + engine.config.num_workers)
    # ...with engine.init_weight_update_group("127.0.0.1", 29500, rank_offset=1, world_size=...) running
    # concurrently (joining blocks until every rank is there), e.g. via `join_engine` below.
    version = broadcaster.push(engine, base_state(model))

Works across machines: the engine's workers only need to reach master_address:master_port. Use
backend "nccl" with tensors on the GPU, "gloo" on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from rollout.api import DEFAULT_BUCKET_BYTES, DEFAULT_COMPONENT
from rollout.weights.broadcast_group import BroadcastEntry, connect, plan_buckets, send_bucket
from rollout.weights.state import TensorSpec


class WeightBroadcaster:
    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        device: str | torch.device = "cpu",
    ):
        """Join the group as rank 0 (hosting its store); blocks until the workers join too."""
        self.device = torch.device(device)
        self.group = connect(master_address, master_port, 0, world_size, backend, timeout_s)

    def broadcast(self, named_tensors: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Send the tensors, in order, in the buckets the receivers derive from the same list."""
        entries = [BroadcastEntry(name, TensorSpec(tuple(t.shape), t.dtype)) for name, t in named_tensors.items()]
        for bucket in plan_buckets(entries, bucket_bytes):
            send_bucket(self.group, [named_tensors[entry.name] for entry in bucket], self.device)

    def push(
        self, engine, named_tensors: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES, **kwargs
    ):
        """For an engine in this process: run `engine.update_weights_from_distributed` while
        broadcasting; returns the new weight version. `kwargs` go to the engine call."""
        names = list(named_tensors)
        dtypes = [named_tensors[n].dtype for n in names]
        shapes = [tuple(named_tensors[n].shape) for n in names]
        engine.check_weight_update(names, dtypes, shapes, kwargs.get("component", DEFAULT_COMPONENT))
        with ThreadPoolExecutor(max_workers=1) as pool:
            receiving = pool.submit(
                engine.update_weights_from_distributed, names, dtypes, shapes, bucket_bytes=bucket_bytes, **kwargs
            )
            self.broadcast(named_tensors, bucket_bytes)
            return receiving.result()


def join_engine(engine, master_address: str, master_port: int, backend: str = "gloo") -> WeightBroadcaster:
    """For an engine in this process: form the group with its workers (rank 0 here, the workers
    1..N) and return the broadcaster."""
    world_size = 1 + engine.config.num_workers
    with ThreadPoolExecutor(max_workers=1) as pool:
        joining = pool.submit(engine.init_weight_update_group, master_address, master_port, 1, world_size, backend)
        broadcaster = WeightBroadcaster(master_address, master_port, world_size, backend)
        joining.result()
    return broadcaster
