"""One-line reprs of the engine's outputs: `print(output)` shows which sample it is and what it
holds (ids, status, the shapes and dtypes of its tensors, versions), never the tensors' values,
which would be kilobytes per output."""

from __future__ import annotations

import dataclasses

import torch

MAX_TEXT = 40  # characters of a string field (a prompt) that a repr shows


def dataclass_repr(value, shown: dict[str, object] | None = None, hidden: tuple[str, ...] = ()) -> str:
    """`Name(field=summary, ...)` over `value`'s dataclass fields but `hidden`, those that are None
    left out; `shown` adds fields (name -> the value to summarise), first."""
    fields = dict(shown or {})
    for field in dataclasses.fields(value):
        if field.name not in fields and field.name not in hidden:
            fields[field.name] = getattr(value, field.name)
    parts = [f"{name}={summary(item)}" for name, item in fields.items() if item is not None]
    return f"{type(value).__name__}({', '.join(parts)})"


def summary(value) -> str:
    """A few characters that say what `value` is: a tensor's dtype and shape (`uint8[3, 32, 32]`),
    a nested dataclass's type name, a string cut to `MAX_TEXT` characters, else its repr."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, str):
        return repr(value if len(value) <= MAX_TEXT else value[: MAX_TEXT - 1] + "…")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {summary(item)}" for key, item in value.items()) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__name__}(…)"
    return repr(value)
