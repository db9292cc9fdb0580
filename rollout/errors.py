"""Errors the engine raises across the executor boundary."""

from __future__ import annotations

import importlib


class WorkerError(RuntimeError):
    """A worker function raised. Carries the rank, the remote exception's type (`error_type`, its
    dotted path, and `error_class` where that imports here), its message and the worker-side
    traceback. Callers branch on the type (`raised(ValueError)`), never on the message text."""

    def __init__(self, method: str, rank: int, error_type: str, message: str, remote_traceback: str):
        self.method = method
        self.rank = rank
        self.error_type = error_type
        self.message = message
        self.error = f"{error_type.rpartition('.')[2]}: {message}"
        self.remote_traceback = remote_traceback
        super().__init__(
            f"worker rank {rank} failed in {method!r}: {self.error}\n--- worker traceback ---\n{remote_traceback}"
        )

    @property
    def error_class(self) -> type[BaseException] | None:
        """The remote exception's class, or None where it does not import in this process."""
        module, _, qualname = self.error_type.rpartition(".")
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError, ValueError):
            return None
        return found if isinstance(found, type) and issubclass(found, BaseException) else None

    def raised(self, kind: type[BaseException]) -> bool:
        """Whether the remote exception was a `kind` (a subclass counts)."""
        error_class = self.error_class
        return error_class is not None and issubclass(error_class, kind)

    @staticmethod
    def type_path(error: BaseException) -> str:
        """The dotted path of an exception's type, as `error_type` holds it."""
        return f"{type(error).__module__}.{type(error).__qualname__}"


class RequestFailedError(ValueError):
    """A request failed in a worker with an error of its own; the requests batched with it went on
    (the worker ran the batch's rows one by one to find it). A ValueError: what failed was the
    request, so the service answers it with a 4xx."""

    def __init__(self, request_id: str, error: str):
        self.request_id = request_id
        self.error = error
        super().__init__(f"request {request_id} failed in a worker, alone (its batch-mates went on): {error}")


class RequestIdTaken(ValueError):
    """A `request_id` that an unfinished request's group or sample id already has. Every caller of
    an engine, every client of a server included, shares its ids; a client tells whether the
    request that holds it is its own (`RemoteRolloutEngine.add_request`)."""


class EngineDeadError(RuntimeError):
    """A worker is gone; the engine cannot serve requests any more and must be rebuilt."""


def interrupted_reason(error: BaseException) -> str:
    """Why an engine is dead after `error` (Ctrl-C, SystemExit) interrupted one of its steps."""
    return f"interrupted during an engine step ({type(error).__name__}); create a new engine"
