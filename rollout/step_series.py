"""One per-step quantity of a trajectory (the latents x_0..x_T, or a record such as x̂₀ per step),
kept at some positions of the chain and held in parts that branched samples share.

The leaves of a tree rollout have one history up to each branch step: that prefix is one part,
referenced by every leaf below it, not a copy per leaf. `record_steps` keeps only some positions.
Index by chain position: `series[i]` is entry i (no copy), `series[positions]` stacks entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class StepSeries:
    """Entries of one quantity at chain `positions` (increasing), stored in `parts` whose lengths add
    up to the number of positions. `length` is the chain's length (T+1 for latents, T for a per-step
    record), so negative positions count from its end as in a dense tensor."""

    def __init__(self, positions: Sequence[int] | torch.Tensor, parts: Sequence[torch.Tensor], length: int):
        self.positions = torch.as_tensor(positions, dtype=torch.int64)
        self.parts = tuple(parts)
        self.length = length
        if sum(len(part) for part in self.parts) != len(self.positions):
            raise ValueError(
                f"StepSeries parts hold {sum(len(part) for part in self.parts)} entries for "
                f"{len(self.positions)} positions"
            )
        # Where each kept position lives: (part, row).
        where = [(index, row) for index, part in enumerate(self.parts) for row in range(len(part))]
        self._where = dict(zip(self.positions.tolist(), where, strict=True))

    def __len__(self) -> int:
        """Kept entries."""
        return len(self.positions)

    def __contains__(self, position: int) -> bool:
        return self._normalise(position) in self._where

    def __getitem__(self, key: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Entry at chain position `key`, or the entries at several positions stacked [k, ...]."""
        if isinstance(key, int) or (isinstance(key, torch.Tensor) and key.ndim == 0):
            part, row = self._locate(int(key))
            return self.parts[part][row]
        return torch.stack([self[int(position)] for position in key])

    def stack(self) -> torch.Tensor:
        """Every kept entry, [len(self), ...], as one new tensor (a view when there is one part)."""
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)

    @property
    def entry_shape(self) -> torch.Size:
        return self.parts[0].shape[1:]

    @property
    def nbytes(self) -> int:
        """Bytes of the parts (shared parts count in full here: this is one sample's view)."""
        return sum(part.nbytes for part in self.parts)

    def _normalise(self, position: int) -> int:
        return position + self.length if position < 0 else position

    def _locate(self, position: int) -> tuple[int, int]:
        where = self._where.get(self._normalise(position))
        if where is None:
            kept = self.positions.tolist()
            raise IndexError(
                f"position {position} of this trajectory was not kept (kept: {kept}); widen record_steps to keep it"
            )
        return where

    def __repr__(self) -> str:
        shape = tuple(self.entry_shape)
        return f"StepSeries({len(self)} of {self.length} positions, entries {shape}, {len(self.parts)} parts)"
