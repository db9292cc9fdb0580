"""One per-step quantity of a trajectory (the latents x_0..x_T, or a record such as x̂₀ per step),
kept at some positions of the chain and held in parts that branched samples share.

The leaves of a tree rollout have one history up to each branch step: that prefix is one part,
referenced by every leaf below it, not a copy per leaf. `record_steps` keeps only some positions.

A series answers like the dense [length, ...] tensor it stands for (the first release's
`Trajectory.latents`, and what trainers ported from Flow-GRPO or DanceGRPO index), by chain
position: `series[i]`, `series[1:-1]`, `series[[0, 2]]`, `series[i, 0]`, `.shape`, `.to(device)`,
and `torch.stack([t.latents for t in trajectories])`.

It is not a tensor: tensor methods and arithmetic (`.clone()`, `.float()`, `series * 2`) are
refused with a pointer to `.stack()`. With `record_steps` a series keeps only some positions, so the
k-th kept entry is not position k: handing it to a torch function, or iterating it, would line its
entries up with per-step tensors (`log_probs[:, j]`) wrongly, without an error; both are refused,
and `.stack()` (its kept entries, at `.positions`) or `series[steps]` say which entries one means.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch


class StepSeries:
    """Entries of one quantity at chain `positions` (increasing), stored in `parts` whose lengths add
    up to the number of positions. `length` is the chain's length (T+1 for latents, T for a per-step
    record), so negative positions count from its end as in a dense tensor.

    Indexing is by chain position, as in the dense [length, ...] tensor:
    - `series[i]` (an int or a 0-d int tensor): the entry x_i, a view of its part (no copy);
    - `series[a:b:s]`: the entries at positions `range(length)[a:b:s]`, [k, ...]; a view when they
      lie in one part (a flat rollout's series is one part), else a new tensor;
    - `series[[i, j]]`, `series[index_tensor]`: those positions stacked, a new tensor [k, ...];
      `series[mask]` with a bool mask of `length`: the positions where it is True;
    - `series[key, ...more]`: the entries of `key`, then `more` indexes into them.
    Every position an index reaches must be kept, else IndexError naming `record_steps`: with
    `record_steps`, `series[:]` refuses (use `.stack()`), `series[3:5]` works if 3 and 4 are kept.
    Without `record_steps` every position is kept and the series answers as the dense tensor would.

    `len`, `.shape` ([len(self), *entry_shape]) and `.stack()` count the kept entries.
    Handed to a torch function (`torch.stack`, `torch.cat`, `torch.equal`, ...), a series that
    keeps every position stands for `.stack()`, the dense tensor; one that keeps only some
    (`record_steps`) is refused there and in iteration (`TypeError`): its k-th entry is not position
    k, so `torch.stack([t.latents ...])[:, j]` would not be step j as `log_probs[:, j]` is. Entries
    and views share memory with the parts, which the leaves of a tree share: do not write into them.
    """

    def __init__(self, positions: Sequence[int] | torch.Tensor, parts: Sequence[torch.Tensor], length: int):
        self.positions = torch.as_tensor(positions, dtype=torch.int64)
        self.parts = tuple(parts)
        self.length = length
        if sum(len(part) for part in self.parts) != len(self.positions):
            raise ValueError(
                f"StepSeries parts hold {sum(len(part) for part in self.parts)} entries for "
                f"{len(self.positions)} positions"
            )

    @functools.cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        """Where each kept position lives: (part, row). Built when first asked: a finished
        request's series crosses processes in the step's reply, and many are only stacked."""
        where = [(index, row) for index, part in enumerate(self.parts) for row in range(len(part))]
        return dict(zip(self.positions.tolist(), where, strict=True))

    def __getstate__(self) -> dict:
        # Without the position index, which the receiver rebuilds when asked: it is most of a
        # series' pickle (three objects per position).
        return {"positions": self.positions, "parts": self.parts, "length": self.length}

    def __len__(self) -> int:
        """Kept entries."""
        return len(self.positions)

    def __iter__(self):
        """The entries in position order (views of the parts), when every position is kept."""
        self._check_dense("iterating it")
        for part in self.parts:
            yield from part

    @property
    def keeps_every_position(self) -> bool:
        """Whether every chain position is kept (no `record_steps`): the series is the dense tensor."""
        return len(self.positions) == self.length

    def _check_dense(self, what: str) -> None:
        """Refuse `what` (something that reads the entries by their order, not their positions) on
        a series that keeps only some positions: its k-th entry is not position k."""
        if not self.keeps_every_position:
            raise TypeError(
                f"{what} would give this series' kept entries (positions {self.positions.tolist()} of "
                f"{self.length}, record_steps), so its k-th entry would not be step k as in log_probs, sigmas and "
                "sde_mask; say which you mean: series[steps] picks entries by chain position, series.stack() gives "
                "the kept entries [len(series), ...] (their positions: series.positions)"
            )

    def __contains__(self, position: int) -> bool:
        return self._normalise(position) in self._where

    def __getitem__(self, key) -> torch.Tensor:
        """The entries at chain positions `key` (see the class docstring)."""
        if isinstance(key, tuple):
            return self._index_then_within(key)
        if isinstance(key, slice):
            return self._gather(range(self.length)[key], view=True)
        if isinstance(key, list | range):
            key = torch.as_tensor(list(key)) if len(key) else torch.zeros(0, dtype=torch.int64)
        if isinstance(key, torch.Tensor):
            if key.ndim == 0 and key.dtype != torch.bool and not key.dtype.is_floating_point:
                part, row = self._locate(int(key))
                return self.parts[part][row]
            return self._gather(self._positions_of(key), view=False)
        try:
            position = operator.index(key)
        except TypeError:
            raise TypeError(
                f"a StepSeries is indexed by chain position (an int, a slice, a list or tensor of "
                f"positions, a bool mask), not {type(key).__name__}; .stack() gives a tensor of its kept entries"
            ) from None
        part, row = self._locate(position)
        return self.parts[part][row]

    def stack(self) -> torch.Tensor:
        """Every kept entry, [len(self), ...], as one new tensor (a view when there is one part)."""
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)

    def to(self, *args, memo: dict | None = None, **kwargs) -> StepSeries:
        """This series with its parts moved by `Tensor.to(*args, **kwargs)` (a device, a dtype).

        The leaves of a tree share parts; to keep them shared (and move each once), pass one
        `memo` dict to every call: `memo = {}; [o.trajectory.latents.to("cuda", memo=memo) for o
        in leaves]`. Without one, each call moves its own copy of a shared part."""
        memo = {} if memo is None else memo
        parts = []
        for part in self.parts:
            # Keyed by id, holding the source too: an id is only unique while its tensor lives.
            source, moved = memo.get(id(part), (None, None))
            if source is not part:
                moved = part.to(*args, **kwargs)
                memo[id(part)] = (part, moved)
            parts.append(moved)
        return StepSeries(self.positions, parts, self.length)

    @property
    def shape(self) -> torch.Size:
        """[len(self), *entry_shape]: the kept entries (the dense [length, ...] without record_steps)."""
        return torch.Size([len(self), *self.entry_shape])

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def entry_shape(self) -> torch.Size:
        return self.parts[0].shape[1:]

    @property
    def nbytes(self) -> int:
        """Bytes of the parts (shared parts count in full here: this is one sample's view)."""
        return sum(part.nbytes for part in self.parts)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # A series handed to a torch function stands for the dense tensor, as the first release's
        # Trajectory.latents was: torch.stack([t.latents for t in trajectories]) is [B, T+1, ...].
        name = getattr(func, "__name__", str(func))
        return func(*_stacked(args, name), **_stacked(kwargs or {}, name))

    def __getattr__(self, name: str):
        # Only reached for names a series lacks: a tensor's method gets the pointer to .stack().
        if not name.startswith("_") and hasattr(torch.Tensor, name):
            raise AttributeError(
                f"a StepSeries is not a tensor and has no .{name}; .stack() gives a tensor of its kept entries "
                f"(series.stack().{name}), series[positions] the entries at chain positions"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _no_arithmetic(self, *_):
        raise TypeError(
            "a StepSeries is not a tensor and takes no arithmetic or comparison; .stack() gives a tensor of its "
            "kept entries (series.stack() * 2), series[positions] the entries at chain positions"
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_arithmetic
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _no_arithmetic
    __pow__ = __rpow__ = __matmul__ = __rmatmul__ = __neg__ = __pos__ = __abs__ = _no_arithmetic
    __lt__ = __le__ = __gt__ = __ge__ = _no_arithmetic

    def _index_then_within(self, key: tuple) -> torch.Tensor:
        if not key or key[0] is Ellipsis or key[0] is None:
            raise TypeError(
                f"a StepSeries index starts with chain positions (series[positions, ...]), not {key!r}; "
                ".stack() gives a tensor of its kept entries to index freely"
            )
        picked = self[key[0]]
        try:
            operator.index(key[0])
        except TypeError:  # a slice or positions: picked keeps a leading entry dimension
            return picked[(slice(None), *key[1:])]
        return picked[key[1:]]

    def _positions_of(self, index: torch.Tensor) -> list[int]:
        if index.dtype == torch.bool:
            if index.shape != (self.length,):
                raise IndexError(
                    f"a bool mask over a StepSeries has one entry per chain position, shape ({self.length},), "
                    f"got {tuple(index.shape)}"
                )
            return index.nonzero(as_tuple=True)[0].tolist()
        if index.ndim != 1 or index.dtype.is_floating_point or index.dtype.is_complex:
            raise TypeError(
                f"StepSeries positions are a 1-d list or tensor of ints, got {index.ndim}-d {index.dtype}; "
                ".stack() gives a tensor of its kept entries to index freely"
            )
        return index.tolist()

    def _gather(self, positions: Sequence[int], *, view: bool) -> torch.Tensor:
        """The entries at `positions` [k, ...]: a view of one part if `view` and they lie in one
        part at evenly spaced rows (as a slice of a dense tensor is a view), else stacked anew."""
        located = [self._locate(position) for position in positions]
        if not located:
            return torch.empty((0, *self.entry_shape), dtype=self.dtype, device=self.device)
        parts = {part for part, _ in located}
        rows = [row for _, row in located]
        step = rows[1] - rows[0] if len(rows) > 1 else 1
        evenly = step > 0 and all(b - a == step for a, b in zip(rows, rows[1:], strict=False))
        if view and len(parts) == 1 and evenly:
            return self.parts[located[0][0]][rows[0] : rows[-1] + 1 : step]
        return torch.stack([self.parts[part][row] for part, row in located])

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


def _stacked(value, function: str):
    """`value` with every StepSeries in it (in lists, tuples and dicts too) replaced by `.stack()`;
    a series that keeps only some positions is refused (see `StepSeries._check_dense`)."""
    if isinstance(value, StepSeries):
        value._check_dense(f"torch.{function} on it")
        return value.stack()
    if isinstance(value, list | tuple):
        return type(value)(_stacked(item, function) for item in value)
    if isinstance(value, dict):
        return {name: _stacked(item, function) for name, item in value.items()}
    return value
