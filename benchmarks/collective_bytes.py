"""Counters on a worker's collectives: how many bytes each of its calls sends to the other ranks of
its replica group, counted inside the worker (installed and removed through `collective_rpc`, as
`benchmarks/worker_timers.py` times pieces), with the shapes of every denoiser forward beside them.

    engine.collective_rpc(install_counters)
    ...                                          # the runs to count
    counts = engine.collective_rpc(remove_counters)   # per rank: {"collectives": ..., "forwards": ...}

diffusers' context parallelism calls torch's functional collectives through the module
(`funcol.all_to_all_single(...)`, `dist.all_gather(...)`), so a counter set as the module's
attribute sees every call. What a call sends: an all-to-all, its input but the rows it keeps for
itself (`input_split_sizes[rank]`, or an even share); a gather, its input once to every other rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

# (module, function) pairs counted; the functions diffusers' Ulysses, its gathers, and a CFG
# velocity exchange call.
COUNTED = (
    (funcol, "all_to_all_single"),
    (funcol, "all_gather_tensor"),
    (dist, "all_gather"),
    (dist, "all_gather_into_tensor"),
    (dist, "all_reduce"),
    (dist, "broadcast"),
)


def _rank_and_size(group) -> tuple[int, int]:
    group = group.get_group() if isinstance(group, DeviceMesh) else group
    return dist.get_rank(group), dist.get_world_size(group)


def _all_to_all_sent(tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None, group=None) -> int:
    rank, size = _rank_and_size(group)
    kept_rows = tensor.shape[0] // size if input_split_sizes is None else input_split_sizes[rank]
    return tensor.nbytes - kept_rows * (tensor.nbytes // max(tensor.shape[0], 1))


def _gather_tensor_sent(tensor: torch.Tensor, gather_dim: int = 0, group=None) -> int:
    return tensor.nbytes * (_rank_and_size(group)[1] - 1)


def _gather_list_sent(outputs, tensor: torch.Tensor, group=None, async_op: bool = False) -> int:
    return tensor.nbytes * (_rank_and_size(group)[1] - 1)


def _reduce_sent(tensor: torch.Tensor, *args, group=None, **kwargs) -> int:
    return tensor.nbytes * (_rank_and_size(group)[1] - 1)  # what a direct exchange sends; a ring sends less


SENT = {
    "all_to_all_single": _all_to_all_sent,
    "all_gather_tensor": _gather_tensor_sent,
    "all_gather": _gather_list_sent,
    "all_gather_into_tensor": lambda output, tensor, group=None, async_op=False: _gather_tensor_sent(tensor, 0, group),
    "all_reduce": _reduce_sent,
    "broadcast": _reduce_sent,
}


def _counted(name: str, fn: Callable, counts: dict) -> Callable:
    def wrapper(*args, **kwargs):
        entry = counts.setdefault(name, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += SENT[name](*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def install_counters(worker) -> None:
    """Count every collective call and record every denoiser forward's input shapes (rows, tokens)
    from now on."""
    counts: dict = {}
    forwards: list = []
    restore = []
    for module, name in COUNTED:
        original = getattr(module, name)
        restore.append((module, name, original))
        setattr(module, name, _counted(name, original, counts))

    def record(module, args, kwargs) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        encoder = kwargs.get("encoder_hidden_states")
        forwards.append((tuple(hidden.shape), None if encoder is None else tuple(encoder.shape)))

    handles = [
        denoiser.register_forward_pre_hook(record, with_kwargs=True) for denoiser in worker.adapter.denoisers.values()
    ]
    worker.benchmark_counters = (counts, forwards, restore, handles)


def take_counts(worker) -> dict:
    """What was counted since the last take: collective name -> {"calls", "bytes"}, and the input
    shapes of each forward ((hidden_states shape, encoder_hidden_states shape)); both start empty again."""
    counts, forwards, _, _ = worker.benchmark_counters
    taken = {"collectives": {name: dict(entry) for name, entry in counts.items()}, "forwards": list(forwards)}
    counts.clear()
    forwards.clear()
    return taken


def remove_counters(worker) -> dict:
    """Put the original functions back; returns what was not taken yet."""
    taken = take_counts(worker)
    _, _, restore, handles = worker.benchmark_counters
    for module, name, original in reversed(restore):
        setattr(module, name, original)
    for handle in handles:
        handle.remove()
    del worker.benchmark_counters
    return taken
