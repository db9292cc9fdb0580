"""How far a worker has computed: a count its models advance as they run, which the engine reads
to tell a step that is slow from one that is stuck (`EngineConfig.step_timeout_s`).

Every unit of work of every model of the pipeline adds one to the count as it starts
(`progress_units`): a transformer's blocks, a text encoder's layers (a T5 block's attention and
its feed-forward apart), and a VAE's resnets, attentions and up- and downsamplers one by one (its
down and up blocks hold several of them each, at full resolution, and its mid block's attention
attends over every latent pixel of an image). So the count moves many times per denoiser
forward, text encoding and VAE encode or decode, and the longest stretch without a move is one
such unit: what the engine's admission bounds (`rollout.engine.work_budget`). The count is one
integer in a cell with a `value`: a plain object in the worker's process, or a shared one (a
`multiprocessing` `RawValue`) that another process reads without asking the worker. One writer,
no lock: a reader sees the count as it was a moment ago, which is all a timeout needs.

Once the engine is dead the worker's count is of no use, and neither is the work: `stop` makes
the next unit that starts raise `WorkerStopped`, so a forward the engine gave up on (an
in-process worker's thread cannot be killed) ends there and frees what it held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn


class WorkerStopped(BaseException):
    """Raised where a stopped worker's next unit of work starts (`Progress.stop`). A BaseException,
    as KeyboardInterrupt is, so that no request isolation catches it and runs the work again."""


class Cell:
    """An integer `value` in this process (a shared cell has the same attribute)."""

    __slots__ = ("value",)

    def __init__(self, value: int = 0):
        self.value = value


class Progress:
    """A worker's count of units of work started; `count` only grows while the worker computes.

    `recorder`: None, or a function called with each unit as it starts, after the count
    (`rollout.worker.work_profile` measures each unit's work with it)."""

    def __init__(self) -> None:
        self.cell = Cell()
        self.stopped: str | None = None
        self.recorder: Callable[[nn.Module], None] | None = None

    @property
    def count(self) -> int:
        return self.cell.value

    def count_in(self, cell) -> None:
        """Count in `cell` from now on (a shared cell another process reads), starting at the count so far."""
        cell.value = self.cell.value
        self.cell = cell

    def watch(self, modules: Iterable[nn.Module]) -> int:
        """Advance the count as each unit of `modules` starts; returns how many units are watched."""
        units = [unit for module in modules for unit in progress_units(module)]
        for unit in units:
            unit.register_forward_pre_hook(self._advance)
        return len(units)

    def stop(self, reason: str) -> None:
        """Make every unit that starts from now on raise `WorkerStopped(reason)` (the engine is dead)."""
        self.stopped = reason

    def _advance(self, module: nn.Module, args: tuple) -> None:
        # On the hot path: a few attribute reads and one integer write per unit.
        if self.stopped is not None:
            raise WorkerStopped(self.stopped)
        self.cell.value += 1
        if self.recorder is not None:
            self.recorder(module)


def progress_units(module: nn.Module) -> list[nn.Module]:
    """The units of work of `module`: the elements of its `ModuleList`s, where an element that holds
    lists of composite modules itself (a VAE's down or up block and its resnets, a T5 block and its
    attention and feed-forward layers) gives those instead, and so on down; where it has no
    `ModuleList`, its children (or itself). A list of plain layers (an attention's `to_out`) is no
    list of units: a transformer's blocks stay whole, so a compiled block (`compile='blocks'`)
    holds no hook."""
    units: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if not isinstance(child, nn.ModuleList):
                visit(child)
                continue
            for element in child:
                if _holds_units(element):
                    visit(element)
                else:
                    units.append(element)

    visit(module)
    return units or list(module.children()) or [module]


def _holds_units(module: nn.Module) -> bool:
    """Whether `module` has a `ModuleList` child of composite modules (modules with children)."""
    return any(
        isinstance(child, nn.ModuleList) and any(next(element.children(), None) is not None for element in child)
        for child in module.children()
    )
