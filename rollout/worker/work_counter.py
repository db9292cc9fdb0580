"""Counting and timing floating-point work: what `rollout.worker.work_profile` measures a model's
units of work with. `WorkCounter` counts the FLOPs of the operations torch dispatches (attention
apart from matrix products and convolutions); `flops_per_second` times the device on one kind of
operation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# The attention kernels torch dispatches to (q, k, v first, [B, H, L, D]); the math fallback is
# matrix products, which the other work counts.
_ATTENTION_OPS = frozenset(
    {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    }
)
# How long one timing of the device must run at least (the sizes double until it does): long
# enough that a call's fixed costs do not count.
_TIMED_S = 0.002


class WorkCounter(TorchDispatchMode):
    """Counts the FLOPs of every operation dispatched while it is active: attention apart, with
    the head dimensions it saw, and the rest that torch's flop counter has a formula for."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = 0.0
        self.other = 0.0
        self.head_dims: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet.__name__ in _ATTENTION_OPS:
            query, key = args[0], args[1]
            self.attention += 4.0 * query.numel() * key.shape[-2]  # QK^T and the weighted sum of V
            self.head_dims.add(int(query.shape[-1]))
        elif packet in flop_registry:
            self.other += float(flop_registry[packet](*args, **kwargs, out_val=out))
        return out


def flops_per_second(run: Callable[[int], tuple[Callable[[], object], float]]) -> float:
    """The speed of `run(size)` (a function to time, and its FLOPs), the size doubled from 1 until
    a call takes `_TIMED_S`: the fastest of three calls after a warm-up. The fastest, not a
    typical one: on a machine other programs share, a call the scheduler preempted runs many times
    longer (the median of three moved 50-fold between runs here); admission's margin is for load."""
    size = 1
    while True:
        call, flops = run(size)
        call()
        fastest = math.inf
        for _ in range(3):
            start = time.perf_counter()
            call()
            fastest = min(fastest, time.perf_counter() - start)
        if fastest >= _TIMED_S or size >= 64:
            return flops / fastest
        size *= 2


def attention_run(head_dim: int, device: torch.device, dtype: torch.dtype):
    """`flops_per_second`'s run of one head's attention over 1024 x size tokens."""

    def run(size: int):
        tokens = 1024 * size
        query = torch.randn(1, 1, tokens, head_dim, device=device, dtype=dtype)

        def call():
            torch.nn.functional.scaled_dot_product_attention(query, query, query)
            _synchronize(device)

        return call, 4.0 * tokens * tokens * head_dim

    return run


def matmul_run(device: torch.device, dtype: torch.dtype):
    """`flops_per_second`'s run of a product of two square matrices of 256 x size."""

    def run(size: int):
        n = 256 * size
        matrix = torch.randn(n, n, device=device, dtype=dtype)

        def call():
            torch.mm(matrix, matrix)
            _synchronize(device)

        return call, 2.0 * n**3

    return run


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
