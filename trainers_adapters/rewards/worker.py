"""What a reward worker runs, in a process (`RewardWorkerPool` spawns `run_reward_worker`) or in a
Ray actor (`ray_pool.RayRewardHost`): build the reward from its specs once, on the worker's
device, say so, then answer each group it is sent.

Messages are bytes with a one-byte tag. To the worker: a group (`wire.encode_group`), or
nothing (stop). From it: READY once the models are loaded; SCORES + `encode_scores`; ERROR + JSON
{"type", "message"} when building the reward or scoring a group raised (the worker carries on).
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection

import torch

from trainers_adapters.rewards.composite import CompositeReward
from trainers_adapters.rewards.spec import RewardSpec, build_specs
from trainers_adapters.rewards.wire import decode_group, encode_scores

READY, SCORES, ERROR = b"R", b"S", b"E"


def error_message(error: BaseException) -> bytes:
    return json.dumps(
        {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    ).encode()


def build_on_device(specs: Sequence[RewardSpec], device: str | None, torch_threads: int | None) -> CompositeReward:
    """The worker's reward: each spec's models on `device` (None: where the specs' settings say)."""
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    if device is not None and torch.device(device).type == "cuda" and torch.device(device).index is not None:
        # A reward that says only "cuda" (a user's class, a tensor it makes) lands on this worker's GPU too.
        torch.cuda.set_device(device)
    return build_specs([spec.placed_on(device) for spec in specs] if device is not None else specs)


def answer_group(reward: CompositeReward, payload: bytes) -> bytes:
    """SCORES + the scores of the group in `payload`, or ERROR + what went wrong."""
    try:
        images, prompts, metadata = decode_group(payload)
        return SCORES + encode_scores(reward.score(images, prompts, metadata))
    except Exception as error:
        return ERROR + error_message(error)


def run_reward_worker(
    specs: Sequence[RewardSpec], conn: Connection, index: int, device: str | None, torch_threads: int | None
) -> None:
    """The worker process's main function."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s reward-worker-{index} %(levelname)s: %(message)s")
    try:
        reward = build_on_device(specs, device, torch_threads)
    except Exception as error:
        conn.send_bytes(ERROR + error_message(error))
        return
    conn.send_bytes(READY)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the trainer went away
            return
        if not message:
            return
        try:
            conn.send_bytes(answer_group(reward, message))
        except (BrokenPipeError, OSError):
            return
