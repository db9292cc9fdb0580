"""The mp backend's promises: bitwise equal to uni, prompt failure on worker death, no leftovers."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from executors.shm import REPLY_BLOCK_MAX_BYTES, shm_dir
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.errors import EngineDeadError
from tests.executors.worker_functions import (
    kill_rank_1_of_a_slowed_engine,
    sleep_in_worker,
    wait_gone,
    worker_pid,
)

pytestmark = pytest.mark.timeout(120)


def _mp_engine(tiny_model, **kwargs):
    return RolloutEngine(EngineConfig(model=tiny_model, executor="mp", **kwargs))


@pytest.mark.slow  # repetition for the default suite: CI runs it (make test-slow)
def test_one_worker_with_the_same_threads_is_bitwise_uni(tiny_model):
    params = SamplingParams(num_inference_steps=4, num_samples=3, seed=9)
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        want = engine.generate(["a", "b"], params)
    with _mp_engine(tiny_model, threads_per_worker=torch.get_num_threads()) as engine:
        got = engine.generate(["a", "b"], params)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.trajectory.latents.stack(), w.trajectory.latents.stack())
        assert torch.equal(g.trajectory.log_probs, w.trajectory.log_probs)
        assert torch.equal(g.image, w.image)


def test_killing_a_worker_during_a_rollout_fails_fast(tiny_model):
    engine = _mp_engine(tiny_model, num_workers=2)
    pids, live_rpc_s = kill_rank_1_of_a_slowed_engine(engine)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) died \(exit code -9\) during 'execute'"):
        engine.generate("x", SamplingParams(num_inference_steps=200, num_samples=4, seed=0))
    assert time.monotonic() - start < 1.0 + 5.0
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank 1"):  # later calls fail fast, same error
        engine.collective_rpc("get_rank")
    with pytest.raises(EngineDeadError):
        engine.generate("x", SamplingParams(num_inference_steps=2, seed=0))
    assert time.monotonic() - start < 2 * live_rpc_s + 0.05  # both refused here, not in a worker
    assert wait_gone(pids) == []
    engine.shutdown()


@pytest.mark.slow  # repetition for the default suite: CI runs it (make test-slow)
def test_killing_a_worker_during_an_rpc_fails_fast(tiny_model):
    engine = _mp_engine(tiny_model, num_workers=2)
    pids = engine.collective_rpc(worker_pid)
    killer = threading.Timer(1.0, os.kill, args=(pids[0], signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker rank 0 .* during '.*sleep_in_worker'"):
        engine.collective_rpc(sleep_in_worker, args=(60,))
    assert time.monotonic() - start < 1.0 + 5.0
    assert wait_gone(pids) == []
    engine.shutdown()


@pytest.mark.slow  # an engine of its own; test_shared_memory tests the reused block without one
def test_steps_rewrite_one_reply_block_per_worker_and_outputs_stay_the_callers(tiny_model):
    engine = _mp_engine(tiny_model, num_workers=2)
    prefix = engine.executor._prefix
    first = engine.generate(["a", "b"], SamplingParams(num_inference_steps=3, num_samples=2, seed=0))
    kept = [o.trajectory.latents.stack().clone() for o in first]
    blocks = sorted(shm_dir().glob(f"{prefix}-*"))
    assert 1 <= len(blocks) <= 2 and all("-replies-" in block.name for block in blocks)
    second = engine.generate(["a", "b"], SamplingParams(num_inference_steps=3, num_samples=2, seed=1))
    assert sorted(shm_dir().glob(f"{prefix}-*")) == blocks  # rewritten, no new file per step
    for output, latents in zip(first, kept, strict=True):  # copies: rewriting the block left them alone
        assert torch.equal(output.trajectory.latents.stack(), latents)
    assert not torch.equal(second[0].trajectory.latents.stack(), kept[0])

    over = REPLY_BLOCK_MAX_BYTES // 4 + 1  # float32 elements: a reply over the reused block's limit
    big = engine.collective_rpc(lambda worker: torch.full((over,), float(worker.rank)))
    assert [(len(b), b[-1].item()) for b in big] == [(over, 0.0), (over, 1.0)]
    assert sorted(shm_dir().glob(f"{prefix}-*")) == blocks  # its fresh block was removed once read
    engine.shutdown()
    assert list(shm_dir().glob(f"{prefix}-*")) == []


def _rank_sleeps(worker, seconds: float) -> int:
    time.sleep(seconds if worker.rank == 1 else 0)
    return worker.rank


@pytest.mark.slow  # two workers and three seconds of waiting; the contract suite drops late replies by default
def test_a_late_reply_of_a_rank_not_asked_is_dropped(tiny_model):
    # Rank 1 answers a call given up on while the engine waits on rank 0 alone: every rank's pipe
    # stays watched, so that reply is read and dropped then, and later calls get their own answers.
    with _mp_engine(tiny_model, num_workers=2) as engine:
        assert engine.collective_rpc(_rank_sleeps, args=(0.0,), timeout=30) == [0, 1]  # warm
        with pytest.raises(TimeoutError, match="ranks that did not answer: \\[1\\]"):
            engine.collective_rpc(_rank_sleeps, args=(2.0,), timeout=1.0)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # past the late reply, waiting on rank 0 only
            assert engine.collective_rpc("get_rank", ranks=[0], timeout=30) == [0]
        assert engine.collective_rpc(_rank_sleeps, args=(0.0,), timeout=30) == [0, 1]


@pytest.mark.slow  # repetition for the default suite: CI runs it (make test-slow)
def test_shutdown_and_garbage_collection_leave_no_process_or_shared_memory(tiny_model):
    engine = _mp_engine(tiny_model, num_workers=2)
    pids = engine.collective_rpc(worker_pid)
    prefix = engine.executor._prefix
    engine.generate("x", SamplingParams(num_inference_steps=2, num_samples=2, seed=0))
    engine.shutdown()
    assert wait_gone(pids) == []
    assert list(shm_dir().glob(f"{prefix}-*")) == []

    engine = _mp_engine(tiny_model)
    pids = engine.collective_rpc(worker_pid)
    del engine
    gc.collect()
    assert wait_gone(pids) == []


@pytest.mark.slow  # repetition for the default suite: CI runs it (make test-slow)
def test_a_worker_that_fails_to_load_is_reported_with_its_rank(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    children_before = set(_children())
    with pytest.raises(RuntimeError, match=r"(?s)worker rank 0 failed to start: OSError: .*--- worker traceback ---"):
        _mp_engine(str(broken))
    assert wait_gone(sorted(set(_children()) - children_before)) == []


def _children() -> list[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as children:
        return [int(pid) for pid in children.read().split()]


CALLER = """
import os, signal, sys
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.request_limits import RequestLimits

def pid(worker):
    return os.getpid()

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job starts with it ignored
    long_requests = RequestLimits(max_inference_steps=100_000)  # one that runs until Ctrl-C
    engine = RolloutEngine(EngineConfig(model=sys.argv[1], executor="mp", num_workers=2, request_limits=long_requests))
    print(*engine.collective_rpc(pid), flush=True)
    if sys.argv[2] == "raise":
        raise RuntimeError("the caller failed")
    engine.generate("x", SamplingParams(num_inference_steps=100_000, seed=0))  # until Ctrl-C
"""


# Both in the slow suite: a caller of its own with two workers (three processes importing torch and
# diffusers) is 10-15 s; the default suite keeps test_killing_a_worker_during_a_rollout_fails_fast.
@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "ctrl-c"])
def test_caller_exception_or_ctrl_c_leaves_no_worker(tiny_model, tmp_path, how):
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(CALLER))
    caller = subprocess.Popen(
        [sys.executable, str(script), tiny_model, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pids = [int(pid) for pid in caller.stdout.readline().split()]
        assert len(pids) == 2, caller.stderr.read()
        if how == "ctrl-c":
            time.sleep(1.0)
            caller.send_signal(signal.SIGINT)
        _, stderr = caller.communicate(timeout=60)
    finally:
        caller.kill()
    assert caller.returncode != 0
    assert ("KeyboardInterrupt" if how == "ctrl-c" else "the caller failed") in stderr
    assert wait_gone(pids) == []


@pytest.mark.parametrize(
    ("device", "rank", "visible", "count", "gpu"),
    [
        ("cpu", 3, None, 8, None),  # a CPU worker sees what the engine sees
        ("cuda", 1, None, 1, None),  # one GPU: every worker on it, as before
        ("cuda:1", 2, None, 4, None),  # a named GPU: the user placed every worker
        ("cuda", 0, None, 4, "0"),
        ("cuda", 5, None, 4, "1"),  # more workers than GPUs: they share, rank % count
        ("cuda", 1, "4,6, 7", 3, "6"),  # the engine's own CUDA_VISIBLE_DEVICES, in its order
    ],
)
def test_each_mp_worker_sees_one_gpu_of_the_engines(device, rank, visible, count, gpu):
    from executors.bootstrap import worker_gpu

    assert worker_gpu(device, rank, visible, count) == gpu
