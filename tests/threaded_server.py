"""A uvicorn server on a thread of the test process, for tests that serve an app of their own."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def served(server: uvicorn.Server, what: str, start_timeout_s: float = 20.0) -> Iterator[None]:
    """Run `server` on a daemon thread until the block ends (then stop it, waiting up to 10 s);
    the test fails, naming `what`, if it has not started within `start_timeout_s`."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), f"{what} did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(10)
