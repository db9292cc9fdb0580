"""Start a rollout service in a child process and wait until it answers (tests, benchmarks, and a
trainer that runs its own server):

    with ServerProcess.start("path/to/pipeline", "--executor", "mp", api_key=key) as server:
        engine = RemoteRolloutEngine(server.url, api_key=key)
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

from rollout.serve import API_KEY_ENV
from rollout.serve.instance import INSTANCE_HEADER

STDERR_LINES_KEPT = 20  # of a server that stops before it answers, for the exception


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class ServerProcess:
    """A `python -m rollout.serve` child process on a free loopback port; `stop()` ends it.
    `instance_id`: the id its answers carry (`rollout.serve.instance`), known once it answered."""

    def __init__(self, process: subprocess.Popen, url: str):
        self.process = process
        self.url = url
        self.instance_id: str | None = None
        # Of a server `start` made: its stderr goes on to ours as it comes, and its last lines say why
        # it stopped, if it does.
        self._last_lines: collections.deque[str] = collections.deque(maxlen=STDERR_LINES_KEPT)
        self._stderr_copier: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        model: str,
        *flags: str,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 180.0,
        log_level: str = "warning",
        port: int | None = None,
    ) -> ServerProcess:
        """Start the server with `flags` (those of `python -m rollout.serve`) and wait for /health.
        `env` adds to this process's environment (e.g. OMP_NUM_THREADS); `port`: where it listens
        (None: a free one; given, to start a server again where one was). The key goes through the
        environment, not the command line; without one the server runs with --no-auth. Raises
        RuntimeError with the server's exit code and the last lines of its stderr (why it stopped:
        a port in use, a bad flag, a model that does not load) if it stops before it answers,
        TimeoutError after `timeout_s`."""
        port = free_port() if port is None else port
        env = {**os.environ, **(env or {})}
        env.pop(API_KEY_ENV, None)
        if api_key is not None:
            env[API_KEY_ENV] = api_key
        command = [sys.executable, "-m", "rollout.serve", "--model", str(model), "--port", str(port)]
        if api_key is None:
            command.append("--no-auth")
        process = subprocess.Popen([*command, "--log-level", log_level, *flags], env=env, stderr=subprocess.PIPE)
        server = cls(process, f"http://127.0.0.1:{port}")
        server._stderr_copier = threading.Thread(target=server._copy_stderr, name="rollout-server-stderr", daemon=True)
        server._stderr_copier.start()
        try:
            server._wait_until_healthy(timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self._stderr_copier is not None:
                    self._stderr_copier.join(timeout=5.0)  # its last words, up to the end of the pipe
                last_words = "".join(self._last_lines).strip()
                raise RuntimeError(
                    f"the rollout server exited with code {self.process.returncode} before it answered"
                    + (f"; its stderr ended with:\n{last_words}" if last_words else "")
                )
            try:
                answer = httpx.get(f"{self.url}/health", timeout=5.0)
                if answer.status_code == 200:
                    self.instance_id = answer.headers[INSTANCE_HEADER]
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise TimeoutError(f"the rollout server at {self.url} did not answer /health within {timeout_s} s")

    def _copy_stderr(self) -> None:
        """Copy the server's stderr to this process's file descriptor 2 (where it went before it was
        piped), keeping its last lines; reads to the end, so the server never blocks on a full pipe."""
        for line in iter(self.process.stderr.readline, b""):
            self._last_lines.append(line.decode(errors="replace"))
            try:
                os.write(2, line)
            except OSError:
                pass  # our stderr is gone; keep draining the pipe
        self.process.stderr.close()

    def stop(self, timeout_s: float = 30.0) -> int:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`); returns its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
