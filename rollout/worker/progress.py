"""How far a worker has computed: a count its models advance as they run, which the engine reads
to tell a step that is slow from one that is stuck (`EngineConfig.step_timeout_s`).

Every block of every model of the pipeline (the elements of each model's outermost `ModuleList`s:
a transformer's blocks, a text encoder's layers, a VAE's down and up blocks) adds one to the
count as it starts, so the count moves many times per denoiser forward, text encoding and VAE
encode or decode. The count is one integer in a cell with a `value`: a plain object in the
worker's process, or a shared one (a `multiprocessing` `RawValue`) that another process reads
without asking the worker. One writer, no lock: a reader sees the count as it was a moment ago,
which is all a timeout needs.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


class Cell:
    """An integer `value` in this process (a shared cell has the same attribute)."""

    __slots__ = ("value",)

    def __init__(self, value: int = 0):
        self.value = value


class Progress:
    """A worker's count of model blocks started; `count` only grows while the worker computes."""

    def __init__(self) -> None:
        self.cell = Cell()

    @property
    def count(self) -> int:
        return self.cell.value

    def count_in(self, cell) -> None:
        """Count in `cell` from now on (a shared cell another process reads), starting at the count so far."""
        cell.value = self.cell.value
        self.cell = cell

    def watch(self, modules: Iterable[nn.Module]) -> int:
        """Advance the count as each block of `modules` starts; returns how many blocks are watched."""
        blocks = [block for module in modules for block in outermost_blocks(module)]
        for block in blocks:
            block.register_forward_pre_hook(self._advance)
        return len(blocks)

    def _advance(self, module: nn.Module, args: tuple) -> None:
        # On the hot path: one attribute read and one integer write per block.
        self.cell.value += 1


def outermost_blocks(module: nn.Module) -> list[nn.Module]:
    """The elements of `module`'s `ModuleList`s that lie in no other such element (a model's
    repeated blocks, not the layers inside them); where it has none, its children (or itself)."""
    blocks: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(child)
            else:
                visit(child)

    visit(module)
    return blocks or list(module.children()) or [module]
