"""A real rollout server (a child process on a free loopback port) on the tiny SD3 pipeline, shared
by every service test (each leaves it as it found it: weights, adapters, no requests), and a client."""

from __future__ import annotations

import pytest

from rollout import RemoteRolloutEngine
from rollout.serve.launch import ServerProcess

API_KEY = "test-key-0123456789"
EXTENSION = "tests.serve.worker_extension.ServeTestExtension"
# The extension, and its test hooks opened by name: they change how steps run, so they are not
# marked read-only and /collective_rpc calls them only where the operator allows it.
HOOKS = ("fail_prompt", "set_step_delay", "raise_key_error", "health_checks")
EXTENSION_FLAGS = ("--worker-extension-cls", EXTENSION, *(flag for hook in HOOKS for flag in ("--rpc-allow", hook)))


@pytest.fixture(scope="session")
def server(tiny_model):
    flags = (*EXTENSION_FLAGS, "--max-samples-per-request", "64", "--max-body-mb", "0.05")
    with ServerProcess.start(tiny_model, *flags, "--max-upload-mb", "64", api_key=API_KEY) as running:
        yield running


@pytest.fixture
def remote(server):
    with RemoteRolloutEngine(server.url, api_key=API_KEY) as client:
        yield client
        client.resume()  # leave the shared server running for the next test
