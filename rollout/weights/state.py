"""A model component's weights as the hot-swap API sees them: names, specs, checks, checksums, and
an all-or-nothing swap.

Names are the component's own state-dict names (e.g. `block_sizes.0.attn.to_q.weight`), the
same whether or not LoRA adapters wrap a layer (PEFT's `.base_layer.` is hidden, and LoRA tensors
are not weights here).
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def base_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights by their plain names (parameters and persistent buffers, no LoRA)."""
    return {
        name.replace(".base_layer.", "."): tensor
        for name, tensor in module.state_dict(keep_vars=True).items()
        if ".lora_" not in name
    }


def specs_of(module: nn.Module) -> dict[str, TensorSpec]:
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in base_state(module).items()}


# The one dtype rule of the hot-swap API (weight updates and LoRA loads): a tensor is taken in its
# target's dtype, or in a float dtype every value of which the target holds exactly (bfloat16 and
# float16 into float32; any of them into float64), converted on the way in. Anything that would
# round (float32 into a bfloat16 model, float64 LoRA tensors into the engine's float32 layers) or
# change kind is refused: the engine never changes a value it is given.
_EXACT_WIDENINGS = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}
DTYPE_RULE = (
    "a tensor is taken in the target's dtype or widened exactly (bfloat16 or float16 into float32); "
    "cast it yourself where that would round"
)


def converts_exactly(given: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of dtype `given` is a value of `target` (see `DTYPE_RULE`)."""
    return given == target or (given, target) in _EXACT_WIDENINGS


def spec_problem(name: str, expected: TensorSpec | None, given: TensorSpec) -> str | None:
    """Why a tensor of spec `given` cannot update weight `name` (`expected`: its spec, None if the
    component has no such weight), or None when it can."""
    if expected is None:
        return f"{name}: not a weight of this component"
    if given.shape != expected.shape:
        return f"{name}: expected {expected}, got {given}"
    if not converts_exactly(given.dtype, expected.dtype):
        return f"{name}: expected {expected}, got {given} ({DTYPE_RULE})"
    return None


def update_problems(
    expected: Mapping[str, TensorSpec], named_tensors: Iterable[tuple[str, torch.Tensor]], check_finite: bool
) -> list[str]:
    """One line per offending tensor: unknown name, wrong shape or dtype (`DTYPE_RULE`), non-finite values."""
    problems = []
    for name, tensor in named_tensors:
        problem = spec_problem(name, expected.get(name), TensorSpec(tuple(tensor.shape), tensor.dtype))
        if problem is not None:
            problems.append(problem)
        elif check_finite and not all_finite(tensor):
            problems.append(f"{name}: holds NaN or infinite values")
    return problems


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of `tensor` is finite (always, for integer tensors).

    One summing pass, without the elementwise mask `torch.isfinite(t).all()` writes: a NaN or an
    infinity makes the sum NaN or infinite. Only a sum that overflows although every element is
    finite pays for the exact elementwise check."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def non_finite_problems(named_tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """One line per tensor holding NaN or infinite values."""
    return [f"{name}: holds NaN or infinite values" for name, t in named_tensors.items() if not all_finite(t)]


def refusal_message(component: str, problems: list[str]) -> str:
    listing = "\n  ".join(problems)
    return f"update refused, weights unchanged: {len(problems)} problem(s) in {component}:\n  {listing}"


def checksum(named_tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order.

    The trainer computes it on its copy (`checksum(base_state(module))`) and compares it with the
    engine's `weights_checksum()`: equal digests mean bitwise equal weights.
    """
    digest = hashlib.sha256()
    for name in sorted(named_tensors):
        tensor = named_tensors[name].detach()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        data = tensor.to("cpu").contiguous().reshape(-1)
        if data.numel():
            digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class WeightSwap:
    """Replace some weights of a module at once and keep the old tensors until `commit` or `rollback`.

    Swapping storage (instead of copying into it) makes applying cheap and rolling back free; the
    price is holding the old and new tensors together until the update is committed.
    """

    def __init__(self, module: nn.Module, new_tensors: Mapping[str, torch.Tensor]):
        self.module = module
        self._real_names = _real_names(module)
        # One walk for every owner (`get_submodule` walks the path again for each weight: ~50 us each).
        self._owners = dict(module.named_modules())
        self._old: dict[str, torch.Tensor] = {}
        try:
            for name, tensor in new_tensors.items():
                self._old[name] = _set_tensor(self._owners, self._real_names[name], tensor)
        except BaseException:
            self.rollback()  # a swap that fails part-way leaves the module as it was
            raise

    def rollback(self) -> None:
        for name, tensor in self._old.items():
            _set_tensor(self._owners, self._real_names[name], tensor)
        self._old.clear()

    def commit(self) -> None:
        self._old.clear()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are one view of one storage."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def _real_names(module: nn.Module) -> dict[str, str]:
    """Plain name -> name in the module as it is now (PEFT puts weights under `.base_layer.`)."""
    return {
        name.replace(".base_layer.", "."): name for name in module.state_dict(keep_vars=True) if ".lora_" not in name
    }


def _set_tensor(owners: Mapping[str, nn.Module], name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Point weight `name` (its owner in `owners`, the module's `named_modules()`) at `tensor`'s
    storage; returns the tensor it held before."""
    owner_name, _, leaf = name.rpartition(".")
    owner = owners[owner_name]
    if leaf in owner._parameters:
        parameter = owner._parameters[leaf]
        old = parameter.data
        parameter.data = tensor
        return old
    old = owner._buffers[leaf]
    owner._buffers[leaf] = tensor
    return old


class StagedUpdates:
    """A worker's weight updates in flight: staged (not yet visible), then swapped in, then kept
    for a possible rollback until the engine says every rank has applied its part."""

    def __init__(self, components: Mapping[str, nn.Module]):
        self.components = components
        self._staged: dict[str, dict[str, torch.Tensor]] = {}
        self._swaps: dict[str, list[WeightSwap]] = {}
        # component -> other module trees over its weights' storage (a colocated trainer's denoisers:
        # `rollout.pipelines.shared_base`), swapped with it; held weakly: a dropped trainer leaves.
        self._sharers: dict[str, weakref.WeakSet[nn.Module]] = {}

    def share(self, component: str, module: nn.Module) -> None:
        """Swap every update of `component` into `module` too, in the same `apply` and the same
        `rollback` or `commit`: a module of the same architecture whose base weights are the
        component's own tensors (checked: the same storage), so that it keeps seeing them."""
        own, theirs = base_state(self.module(component)), base_state(module)
        differ = sorted(
            n for n in own.keys() | theirs.keys() if n not in own or n not in theirs or not _same(own[n], theirs[n])
        )
        if differ:
            raise ValueError(
                f"cannot share {component}'s weights with a module that does not hold them: {differ[:3]} "
                f"({len(differ)} tensors) differ in name or storage; build it with rollout.pipelines.shared_base"
            )
        self._sharers.setdefault(component, weakref.WeakSet()).add(module)

    def shared(self) -> list[str]:
        """The components whose weights another module tree shares now."""
        return sorted(component for component, sharers in self._sharers.items() if len(sharers))

    def module(self, component: str) -> nn.Module:
        if component not in self.components:
            raise ValueError(f"unknown component {component!r}; this model has {sorted(self.components)}")
        return self.components[component]

    def stage(self, component: str, named_tensors: Mapping[str, torch.Tensor]) -> int:
        """Keep tensors for `apply`, on the component's device and in its dtype (checked to widen
        exactly). They must be this worker's own (executors hand worker functions private copies,
        or tensors handed over to them), so no copy is made here on CPU in the same dtype."""
        state = base_state(self.module(component))
        staged = self._staged.setdefault(component, {})
        for name, tensor in named_tensors.items():
            live = state[name]
            same = tensor.device == live.device and tensor.dtype == live.dtype  # the common case: `to` costs ~10 us
            staged[name] = tensor if same else tensor.to(device=live.device, dtype=live.dtype)
        return len(staged)

    def stage_checked(self, component: str, parts: Iterable[Mapping[str, torch.Tensor]], check_finite: bool) -> int:
        """Stage every part (a file's or a bucket's tensors, read as they are iterated), refusing
        NaN and infinity with `check_finite`. Every part is read even after a refusal, so a sender
        streaming them (a broadcast) is never left waiting; then ValueError lists every offender."""
        problems: list[str] = []
        for tensors in parts:
            if check_finite:
                problems += non_finite_problems(tensors)
            if not problems:
                self.stage(component, tensors)
        if problems:
            self._staged.pop(component, None)
            raise ValueError(refusal_message(component, problems))
        return len(self._staged.get(component, {}))

    def stage_pairs(self, component: str, pairs: Iterable[tuple[str, torch.Tensor]], check_finite: bool) -> int:
        """Stage (name, tensor) pairs that a worker function produced, each checked as the engine
        checks a tensor of `update_weights` (name, shape, dtype, and with `check_finite` its
        values); returns how many are staged. ValueError listing every offender, nothing staged."""
        specs = specs_of(self.module(component))
        accepted: dict[str, torch.Tensor] = {}
        problems: list[str] = []
        for name, tensor in pairs:
            if name in accepted:
                problems.append(f"{name}: given twice")
                continue
            problems += update_problems(specs, [(name, tensor)], check_finite)
            accepted[name] = tensor
        if not accepted:
            problems.insert(0, "the update holds no tensors")
        if problems:
            raise ValueError(refusal_message(component, problems))
        return self.stage(component, accepted)

    def staged_is_live(self, component: str) -> bool:
        """Whether every tensor staged for `component` equals the weight it would replace (a re-push
        of the weights held, which changes nothing)."""
        live = base_state(self.module(component))
        return all(torch.equal(live[name], tensor) for name, tensor in self._staged.get(component, {}).items())

    def apply(self, component: str) -> int:
        """Swap every staged tensor in at once; returns how many."""
        staged = self._staged.pop(component, {})
        modules = [self.module(component), *self._sharers.get(component, ())]
        swaps = self._swaps[component] = []
        try:
            for module in modules:
                swaps.append(WeightSwap(module, staged))
        except BaseException:
            self.rollback(component)
            raise
        return len(staged)

    def rollback(self, component: str) -> None:
        self._staged.pop(component, None)
        for swap in self._swaps.pop(component, ()):
            swap.rollback()

    def commit(self, component: str) -> None:
        for swap in self._swaps.pop(component, ()):
            swap.commit()
