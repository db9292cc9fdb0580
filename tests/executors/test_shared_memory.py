"""Shared memory between the engine and its worker processes: private to the user, a full /dev/shm
is a clear error, blocks of dead engines are removed, and nothing a caller keeps pins it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

import executors.shm
from executors.shm import ReusableBlock, SharedMemoryFull, pack, remove_stale_blocks, shm_dir, unpack
from rollout import EngineConfig, RolloutEngine, SamplingParams

pytestmark = pytest.mark.timeout(120)


def _prefix() -> str:
    return f"rollout-{os.getpid()}-test{os.urandom(3).hex()}"


def test_blocks_are_readable_by_their_user_only():
    packed = pack({"t": torch.arange(1000.0)}, _prefix())
    reusable = ReusableBlock(_prefix())
    reused = pack(torch.ones(10), "unused", reusable)
    try:
        for name in (packed.block, reused.block):
            assert stat.S_IMODE(os.stat(shm_dir() / name).st_mode) == 0o600
        assert torch.equal(unpack(packed, remove=True)["t"], torch.arange(1000.0))
        assert not (shm_dir() / packed.block).exists()
    finally:
        reusable.abandon()


def test_a_full_shared_memory_folder_is_a_clear_error(monkeypatch):
    """Simulated: posix_fallocate says there is no space, as it does on a full tmpfs (where writing
    through a mapping would have raised SIGBUS instead)."""

    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(executors.shm.os, "posix_fallocate", no_space)
    prefix = _prefix()
    with pytest.raises(SharedMemoryFull, match=r"MiB free, too little for a block of 3\.8 MiB.*--shm-size"):
        pack(torch.zeros(1_000_000), prefix)
    assert not list(shm_dir().glob(f"{prefix}-*"))  # nothing half-written is left


def test_blocks_of_dead_engines_are_removed():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    stale = shm_dir() / f"rollout-{dead_pid}-deadbeef-r0-0123"
    ours = shm_dir() / f"rollout-{os.getpid()}-cafecafe-r0-0123"
    for path in (stale, ours):
        path.write_bytes(b"x")
    try:
        assert remove_stale_blocks() >= 1
        assert not stale.exists() and ours.exists()
    finally:
        stale.unlink(missing_ok=True)
        ours.unlink(missing_ok=True)


def _shm_used_bytes() -> int:
    stats = os.statvfs(shm_dir())
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


@pytest.mark.slow  # 14 s of 100 rollouts on 2 cores; benchmarks.faults measures the same growth
def test_outputs_the_caller_keeps_do_not_pin_shared_memory(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model, executor="mp", num_workers=2)) as engine:
        params = SamplingParams(num_inference_steps=3, num_samples=4, seed=0)
        engine.generate("warm up", params)
        before = _shm_used_bytes()
        kept = [engine.generate([f"prompt {i}", f"other {i}"], params) for i in range(10)]
        held = sum(o.trajectory.latents.nbytes for outputs in kept for o in outputs)
        grown = _shm_used_bytes() - before
    assert held > 1_000_000
    assert grown < held / 10, f"/dev/shm grew by {grown} bytes while the caller holds {held} bytes of latents"
