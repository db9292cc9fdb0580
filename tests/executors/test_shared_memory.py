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
from executors.shm import (
    ReusableBlock,
    ReusedBlockReader,
    SharedMemoryFull,
    pack,
    remove_stale_blocks,
    shm_dir,
    unpack,
)
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


def test_a_reused_block_is_read_through_one_mapping_until_it_grows():
    """A worker's replies: small ones rewrite one block the reader keeps mapped, a bigger one
    grows it under a new name (the old one is gone), one over the limit takes a fresh block."""
    prefix = _prefix()
    writer, reader = ReusableBlock(prefix, max_bytes=64 * 1024), ReusedBlockReader()
    try:
        shared = torch.arange(6, dtype=torch.int16)
        first = pack({"x": torch.arange(10.0), "y": [shared, shared], "e": torch.empty(0, 3)}, "unused", writer)
        second = pack({"x": torch.ones(3, 2, dtype=torch.bfloat16), "z": torch.tensor(True)}, "unused", writer)
        assert first.reused and second.block == first.block  # rewritten in place
        got = unpack(second, remove=True, reader=reader)
        assert torch.equal(got["x"], torch.ones(3, 2, dtype=torch.bfloat16)) and got["z"].item() is True
        assert (shm_dir() / second.block).exists()  # a reused block is never removed by its reader
        got["x"].add_(1)  # the reader's own copy: the block is untouched
        assert torch.equal(unpack(second, remove=True, reader=reader)["x"], torch.ones(3, 2, dtype=torch.bfloat16))

        grown = pack(torch.arange(4000.0), "unused", writer)
        assert grown.reused and grown.block != first.block and not (shm_dir() / first.block).exists()
        assert torch.equal(unpack(grown, remove=True, reader=reader), torch.arange(4000.0))
        assert reader.name == grown.block

        shared_again = pack({"y": [shared, shared]}, "unused", writer)
        got = unpack(shared_again, remove=True, reader=reader)
        assert got["y"][0] is got["y"][1] and torch.equal(got["y"][0], shared)

        big = pack(torch.zeros(20_000), prefix, writer)  # 80 KB, over the writer's 64 KiB
        assert not big.reused and big.block != writer.name
        assert torch.equal(unpack(big, remove=True, reader=reader), torch.zeros(20_000))
        assert not (shm_dir() / big.block).exists()
    finally:
        reader.close()
        writer.abandon()
    assert not list(shm_dir().glob(f"{prefix}-*"))


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
        # Calls of the measured calls' size: each worker's reply block grows to fit them here.
        engine.generate(["warm up", "other warm up"], params)
        before = _shm_used_bytes()
        kept = [engine.generate([f"prompt {i}", f"other {i}"], params) for i in range(10)]
        held = sum(o.trajectory.latents.nbytes for outputs in kept for o in outputs)
        grown = _shm_used_bytes() - before
    assert held > 1_000_000
    assert grown < held / 10, f"/dev/shm grew by {grown} bytes while the caller holds {held} bytes of latents"
