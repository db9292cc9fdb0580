"""The wire format between an engine and its worker processes: small, explicit messages.

Bulk data (the step's inputs and outputs, RPC arguments and results) travels inside `Packed`
objects, whose tensors live in shared memory (see `executors.shm`). A message crosses the pipe as
one plain pickle (`send` / `receive`): `Connection.send` pickles with multiprocessing's reducer
table, whose lookup per object took half of a reply's pickling, for reducers (file descriptors,
shared tensors) no message uses.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection

from executors.shm import Packed


@dataclass(frozen=True)
class Call:
    """Engine -> worker. `method` is a worker method name, or cloudpickled bytes of a callable
    `fn(worker, *args, **kwargs)`. `arguments` packs (args, kwargs)."""

    call_id: int
    method: str | bytes
    arguments: Packed


@dataclass(frozen=True)
class Reply:
    """Worker -> engine: the packed result of call `call_id`, or the error it raised (its message,
    the dotted path of its type, and the traceback). A worker's first reply answers the ready
    handshake: its pid once its model is loaded, or why loading failed."""

    call_id: int
    result: Packed | None = None
    error: str | None = None
    error_type: str | None = None
    traceback: str | None = None


@dataclass(frozen=True)
class Shutdown:
    """Engine -> worker: exit the loop."""


Message = Call | Reply | Shutdown


def send(conn: Connection, message: Message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Message:
    """The next message from `conn` (EOFError or OSError when the peer is gone)."""
    return pickle.loads(conn.recv_bytes())
