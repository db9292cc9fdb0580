"""Which exception is which HTTP status, for the server and the client alike.

The server answers an engine exception with the status of the first class it is an instance of and
the body {"error": {"type": <class name>, "message": ...}}; the client raises the class that type
names (or, for a type it does not know, the class its status stands for). A worker function's
error carries its worker's fields too, and the client raises the `WorkerError` the engine raised.
"""

from __future__ import annotations

from rollout.errors import EngineDeadError, RequestIdTaken, WorkerError
from rollout.http.wire import WireError

# Most specific first: an exception gets the status of the first class it is an instance of.
STATUS_OF: list[tuple[type[BaseException], int]] = [
    (EngineDeadError, 503),
    (TimeoutError, 504),
    (WireError, 400),
    (RequestIdTaken, 400),
    (ValueError, 400),
    (TypeError, 400),
    (RuntimeError, 409),  # the engine's state forbids it now (asleep, adapter in use, ...)
]

# What the client raises: the error body's type, by name; else by status (401/403 are the key's).
_BY_NAME: dict[str, type[Exception]] = {error.__name__: error for error, _ in STATUS_OF}
_BY_STATUS: dict[int, type[Exception]] = {status: error for error, status in STATUS_OF if status != 400}
_BY_STATUS |= {401: PermissionError, 403: PermissionError}


def exception_for(error_type: str, message: str, status: int) -> Exception:
    """The exception a client raises for an error answer."""
    cls = _BY_NAME.get(error_type) or _BY_STATUS.get(status) or (ValueError if status < 500 else RuntimeError)
    return cls(message)


def worker_error_fields(error: WorkerError) -> dict:
    """What of a `WorkerError` goes in its error body, under "worker"."""
    return {
        "method": error.method,
        "rank": error.rank,
        "error_type": error.error_type,
        "message": error.message,
        "traceback": error.remote_traceback,
    }


def worker_error(fields: dict) -> WorkerError:
    """The `WorkerError` of an error body's "worker" fields."""
    return WorkerError(fields["method"], fields["rank"], fields["error_type"], fields["message"], fields["traceback"])
