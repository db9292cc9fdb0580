"""Host values onto the device without making the host wait: what a denoising step needs from the
host (each row's sigmas and scales, the rows a pass runs, the step noise drawn from the requests'
CPU generators) is built on the host and copied from pinned memory with `non_blocking`.

A plain `.to("cuda")` of a pageable CPU tensor (or `torch.tensor(values, device="cuda")`) returns
only once the copy is done, and the copy waits behind every kernel already queued: the host stops
until the GPU drains, then the GPU idles while the host queues the next kernels. From pinned memory
the copy is queued on the current stream like a kernel, and the caching host allocator keeps the
pinned block alive until the copy has run. On a CPU device these are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_buffer(shape: Sequence[int], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor to fill and then send with `to_device`: pinned for a CUDA device."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=device.type == "cuda")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, queued without waiting (pinned first where it is not)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_to_device(values: Sequence, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of Python `values` (numbers, or equal-length sequences of them) on `device`."""
    return to_device(torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda"), device)


def row_index(rows: Sequence[int], batch: int, device: torch.device) -> torch.Tensor | slice:
    """What selects `rows` (host row numbers) of a batch of `batch` rows on `device`: `slice(None)`
    for every row in order (a view, no gather), else an int64 index (no boolean mask: selecting
    by a mask makes the host wait for the count of its rows)."""
    if len(rows) == batch and all(row == i for i, row in enumerate(rows)):
        return slice(None)
    return host_to_device(list(rows), device, torch.int64)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy of `tensor`, queued without waiting: from a CUDA device into pinned
    memory, valid once the device's current stream has run the copy (`synchronize`). On a CPU
    device the tensor itself where it is float32 already."""
    if tensor.device.type != "cuda":
        return tensor.to("cpu", torch.float32)
    host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def synchronize(device: torch.device) -> None:
    """Wait for what `device`'s current stream has queued (the copies `to_host` made)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
