"""The engine's side of `update_weights`: check, stream in buckets, apply on every rank or on none.

1. Every tensor is checked against the component's names, shapes and dtypes (and for NaN/inf with
   `check_finite`) as it streams past; checked tensors are staged on every rank in buckets of about
   `bucket_bytes`. Staged tensors are invisible to sampling. Tensors the workers read themselves
   (files, a broadcast) have their headers checked here and their values on the workers.
2. If anything was wrong, the staged tensors are dropped and one error lists every offending name.
3. Otherwise every rank swaps its staged tensors in. If any rank fails (or does not answer), every
   rank rolls back; a rollback that fails too, or a commit that fails on some rank, leaves ranks
   that may disagree, so the engine stops with `EngineDeadError` naming the original error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from rollout.broadcast_group import BroadcastEntry, plan_buckets
from rollout.errors import EngineDeadError, WorkerError
from rollout.handed_over import HandedOver
from rollout.safetensors_files import read_specs
from rollout.weights import TensorSpec, refusal_message, spec_problem, update_problems

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
        changed) for a bad update, WorkerError (rolled back everywhere) if a rank failed. The buckets
        of a `HandedOver` update are handed over to the ranks in turn."""
        specs = self.specs(component)
        handed_over = isinstance(named_tensors, HandedOver)
        named_tensors = named_tensors.value if handed_over else named_tensors
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        problems: list[str] = []
        seen: set[str] = set()
        bucket: dict[str, torch.Tensor] = {}
        bucket_size = 0
        with self._all_or_nothing(component):
            for name, tensor in items:
                if name in seen:
                    problems.append(f"{name}: given twice")
                    continue
                seen.add(name)
                problems += update_problems(specs, [(name, tensor)], check_finite)
                if problems:  # once refused, only keep checking
                    continue
                bucket[name] = tensor
                bucket_size += tensor.numel() * tensor.element_size()
                if bucket_size >= bucket_bytes:
                    self._stage(component, bucket, handed_over)
                    bucket, bucket_size = {}, 0
            _raise_if_refused(component, problems, seen)
            if bucket:
                self._stage(component, bucket, handed_over)
        return len(seen)

    def _stage(self, component: str, bucket: dict[str, torch.Tensor], handed_over: bool) -> None:
        self._rpc("stage_weights", args=(component, HandedOver(bucket) if handed_over else bucket))

    def push_from_files(self, files: list[Path], component: str, check_finite: bool) -> int:
        """Like `push`, but every rank reads the safetensors `files` itself; the headers are
        checked here first, the values (with `check_finite`) on the ranks."""
        given = read_specs(files)
        self.check_specs(given, component)
        with self._all_or_nothing(component):
            self._stage_on_ranks("stage_weights_from_files", component, [str(f) for f in files], check_finite)
        return len(given)

    def push_from_broadcast(
        self, entries: list[BroadcastEntry], component: str, bucket_bytes: int, check_finite: bool
    ) -> int:
        """Like `push`, but the tensors arrive through the trainer's broadcast group; the names,
        shapes and dtypes announced in `entries` are checked here first, the values (with
        `check_finite`) on the ranks once received."""
        self.check_specs({e.name: e.spec for e in entries}, component)
        with self._all_or_nothing(component):
            buckets = plan_buckets(entries, bucket_bytes)
            self._stage_on_ranks("stage_weights_from_broadcast", component, buckets, check_finite)
        return len(entries)

    def _stage_on_ranks(self, method: str, *args) -> None:
        """Run a staging worker function; a rank's refusal (ValueError) is the update's refusal."""
        try:
            self._rpc(method, args=args)
        except WorkerError as error:
            if error.raised(ValueError):
                raise ValueError(error.message) from error
            raise

    def check_specs(self, given: Mapping[str, TensorSpec], component: str) -> None:
        """Raise ValueError listing every name that is unknown or has the wrong shape or dtype."""
        specs = self.specs(component)
        problems = [problem for name, spec in given.items() if (problem := spec_problem(name, specs.get(name), spec))]
        _raise_if_refused(component, problems, given)

    @contextmanager
    def _all_or_nothing(self, component: str):
        """Stage in the block, then swap in on every rank and commit. Whatever goes wrong before the
        commit (a refused update, a rank failing to apply) rolls every rank back."""
        try:
            yield
            self._rpc("apply_staged_weights", args=(component,))
        except BaseException as error:
            self._roll_back(component, error)
            raise
        try:
            self._rpc("commit_weights", args=(component,))
        except (WorkerError, TimeoutError) as error:
            raise EngineDeadError(
                f"committing the update of {component} failed on some rank ({_brief(error)}); ranks that "
                "committed and ranks that did not may now hold different weights: create a new engine"
            ) from error

    def _roll_back(self, component: str, cause: BaseException) -> None:
        try:
            self._rpc("rollback_weights", args=(component,))
        except Exception as error:
            raise EngineDeadError(
                f"the update of {component} failed ({_brief(cause)}) and rolling it back failed too "
                f"({_brief(error)}); ranks may hold different weights: create a new engine"
            ) from cause


def _brief(error: BaseException) -> str:
    """One line for an error: a worker's own exception, or the local one (tracebacks stay chained)."""
    if isinstance(error, WorkerError):
        return f"rank {error.rank}: {error.error}"
    return f"{type(error).__name__}: {error}"


def _raise_if_refused(component: str, problems: list[str], names) -> None:
    if not names:
        problems = ["the update holds no tensors", *problems]
    if problems:
        raise ValueError(refusal_message(component, problems))
