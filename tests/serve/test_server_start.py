"""Starting a server where it cannot run: it claims its port before it loads anything, so a port
in use fails the start at once, and `ServerProcess.start` says why the server stopped."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from rollout.serve.launch import ServerProcess


@pytest.mark.timeout(120)
def test_a_busy_port_fails_the_start_before_the_model_loads_and_says_why(tiny_model, tmp_path):
    # A folder the config check takes, whose transformer cannot load: a server that loaded before it
    # bound would fail on the weights; one that binds first fails on the port.
    unloadable = Path(shutil.copytree(tiny_model, tmp_path / "pipeline"))
    for weights in (unloadable / "transformer").glob("*.safetensors"):
        weights.unlink()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refusal = rf"(?s)exited with code 1 .*cannot listen on 127\.0\.0\.1:{port}: Address already in use"
        with pytest.raises(RuntimeError, match=refusal):
            ServerProcess.start(str(unloadable), port=port)
