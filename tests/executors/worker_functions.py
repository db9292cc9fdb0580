"""Worker functions the fault tests send through `collective_rpc`, and process checks.

Ray workers cannot import this module: tests that use Ray register it to be pickled by value.
"""

from __future__ import annotations

import os
import signal
import threading
import time


def worker_pid(worker) -> int:
    return os.getpid()


def slow_down_steps(worker, seconds: float) -> None:
    """Make every later denoising step of this worker take `seconds` longer."""
    step = worker.runner.step

    def slow_step(states):
        time.sleep(seconds)
        step(states)

    worker.runner.step = slow_step


def slow_down_blocks(worker, seconds: float, hang_at: int | None = None, hang_s: float = 0.0) -> None:
    """From now on each block of this worker's transformer sleeps `seconds` as it starts, after it
    advanced the worker's progress; block `hang_at`, if given, sleeps `hang_s` instead."""
    for index, block in enumerate(worker.adapter.denoisers["transformer"].transformer_blocks):
        pause = hang_s if index == hang_at else seconds
        block.register_forward_pre_hook(lambda module, args, pause=pause: time.sleep(pause))


def fail_requests_of(worker, prompt: str, stage: str = "step") -> None:
    """From now on the worker fails for requests of `prompt` as a request the model cannot take
    makes it fail: at "step", the forward pass of any batch holding one; at "encode", encoding
    that text."""
    runner = worker.runner
    if stage == "step":
        step = runner.step

        def failing_step(states):
            if any(state.data.prompt == prompt for state in states):
                raise RuntimeError(f"injected step failure for {prompt!r}")
            step(states)

        runner.step = failing_step
    else:
        encode = runner.adapter.encode_prompts

        def failing_encode(texts, length, images=None):
            if prompt in texts:
                raise RuntimeError(f"injected encode failure for {prompt!r}")
            return encode(texts, length, images)

        runner.adapter.encode_prompts = failing_encode


def fail_inside_the_forward(worker) -> None:
    """From now on this worker's transformer raises inside its forward: after its blocks (and, in
    a sequence-parallel group, their all-to-alls), before its output projection gathers the
    sequence (FLUX.1's `norm_out`)."""

    def fail(module, args):
        raise RuntimeError(f"injected failure inside the forward on rank {worker.rank}")

    worker.adapter.denoisers["transformer"].norm_out.register_forward_pre_hook(fail)


def fail_decodes_of_height(worker, height: int) -> None:
    """From now on decoding images `height` pixels high fails (the batch of that size)."""
    decode = worker.runner.adapter.decode

    def failing_decode(latents, image_height, width):
        if image_height == height:
            raise RuntimeError(f"injected decode failure at height {height}")
        return decode(latents, image_height, width)

    worker.runner.adapter.decode = failing_decode


def stop_failing(worker) -> None:
    vars(worker.runner).pop("step", None)
    vars(worker.runner.adapter).pop("encode_prompts", None)
    vars(worker.runner.adapter).pop("decode", None)


def sleep_in_worker(worker, seconds: float) -> None:
    time.sleep(seconds)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie still answers kill(0) but has exited
        return stat.read().split()[2] != "Z"


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after `timeout` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def kill_rank_1_of_a_slowed_engine(engine, after_s: float = 1.0) -> tuple[list[int], float]:
    """Slow `engine`'s denoising steps by 0.2 s each and SIGKILL its rank 1 `after_s` from now;
    returns the workers' pids and how long a collective_rpc to the live workers took (what a call
    the engine refuses by itself must beat)."""
    pids = engine.collective_rpc(worker_pid)
    start = time.monotonic()
    engine.collective_rpc(slow_down_steps, args=(0.2,))
    live_rpc_s = time.monotonic() - start
    threading.Timer(after_s, os.kill, args=(pids[1], signal.SIGKILL)).start()
    return pids, live_rpc_s
