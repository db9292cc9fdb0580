"""The engine's side of `update_weights`: check, stream in buckets, apply on every rank or on none.

1. Every tensor is checked against the component's names, shapes and dtypes (and for NaN/inf with
   `check_finite`) as it streams past; checked tensors are staged on every rank in buckets of about
   `bucket_bytes`. Staged tensors are invisible to sampling.
2. If anything was wrong, the staged tensors are dropped and one error lists every offending name.
3. Otherwise every rank swaps its staged tensors in. If any rank fails, every rank rolls back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from rollout.errors import WorkerError
from rollout.weights import TensorSpec, update_problems

DEFAULT_BUCKET_BYTES = 512 * 2**20


class WeightSync:
    def __init__(self, collective_rpc: Callable):
        self._rpc = collective_rpc
        self._specs: dict[str, dict[str, TensorSpec]] = {}

    def specs(self, component: str) -> dict[str, TensorSpec]:
        if component not in self._specs:
            self._specs[component] = self._rpc("weight_specs", args=(component,), ranks=[0])[0]
        return self._specs[component]

    def push(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        component: str,
        check_finite: bool,
        bucket_bytes: int,
    ) -> int:
        """Apply the update on every rank; returns the number of tensors. Raises ValueError (nothing
        changed) for a bad update, WorkerError (rolled back everywhere) if a rank failed."""
        specs = self.specs(component)
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        problems: list[str] = []
        seen: set[str] = set()
        bucket: dict[str, torch.Tensor] = {}
        bucket_size = 0
        try:
            for name, tensor in items:
                if name in seen:
                    problems.append(f"{name}: given twice")
                    continue
                seen.add(name)
                found = update_problems(specs, [(name, tensor)], check_finite)
                problems += found
                if found or problems:  # once refused, only keep checking
                    continue
                bucket[name] = tensor
                bucket_size += tensor.numel() * tensor.element_size()
                if bucket_size >= bucket_bytes:
                    self._rpc("stage_weights", args=(component, bucket))
                    bucket, bucket_size = {}, 0
            if not seen:
                problems.append("the update holds no tensors")
            if problems:
                raise ValueError(
                    f"update refused, weights unchanged: {len(problems)} problem(s) in {component}:\n  "
                    + "\n  ".join(problems)
                )
            if bucket:
                self._rpc("stage_weights", args=(component, bucket))
            self._apply_everywhere(component)
        except BaseException:
            self._rpc("rollback_weights", args=(component,))  # drops what was staged
            raise
        return len(seen)

    def _apply_everywhere(self, component: str) -> None:
        try:
            self._rpc("apply_staged_weights", args=(component,))
        except WorkerError:
            self._rpc("rollback_weights", args=(component,))
            raise
        self._rpc("commit_weights", args=(component,))
