"""The bytes of tensor storage alive at once while a piece of code runs, counted by storage: each
storage an op makes is counted once (views share theirs) from its creation until it is freed (a
weak-reference finalizer), whatever device it is on, fake tensors too, so the same count runs on
real tensors and on `FakeTensorMode`'s shape-only ones. Tensors made before the block (the model's
weights) are not counted: the figure is what the block adds on top of them.

What it cannot see: memory a kernel allocates inside itself without making a tensor (a fused
attention's workspace), and the allocator's rounding and caching; a CUDA allocator's peak is
therefore a little above it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorBytes(TorchDispatchMode):
    """Use as a context manager; `peak_bytes` and `current_bytes` during and after it."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        """`existing`: tensors made before the block (the model's weights) whose storage an op may
        hand back as a view (`weight.t()` in a linear layer): not counted, as the block adds none."""
        super().__init__()
        self._counted = WeakIdKeyDictionary()  # storage -> its bytes; the key goes when the storage does
        self._existing = [tensor.untyped_storage() for tensor in existing]  # held, so their keys stay
        for storage in self._existing:
            self._counted[storage] = 0
        self.current_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        if storage in self._counted:  # a view, or an in-place op's result
            return
        size = storage.nbytes()
        self._counted[storage] = size
        self.current_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.current_bytes -= size
