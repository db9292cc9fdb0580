"""Tensors a caller hands over to the engine for good, so that the engine may keep them uncopied.

Every executor gives worker functions tensors of their own: a caller may change or free its tensors
right after `update_weights` or `collective_rpc` returns (a trainer's next optimizer step works in
place). Across a process boundary that copy comes with the transport; for the in-process executor
it is a clone of every tensor argument. A caller that built its tensors only to give them away,
and never reads or writes them again, wraps them in `HandedOver`. The in-process executor then
passes them on as they are, with no clone. The HTTP server's streamed push does this for the
tensors it decodes from a request body: views of buffers that only the server holds. There the
clone was a full second pass over the update and a second copy of it in memory. Executors whose
workers run elsewhere copy the tensors across as always.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HandedOver:
    """`value` (a tensor, or lists, tuples and dicts of them; for `update_weights`, a name -> tensor
    mapping or an iterable of (name, tensor) pairs) whose tensors the caller gives up: it will
    not read, write or free them again. Workers may keep them as their own weights."""

    value: Any

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """The (name, tensor) pairs of a wrapped update, so a front that copies anyway (the HTTP
        client, executors of other processes) takes a `HandedOver` update like any other."""
        return iter(self.value.items() if isinstance(self.value, Mapping) else self.value)
