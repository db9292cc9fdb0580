"""The loop of one reward worker process (`RewardWorkerPool` spawns it): build the reward from its
specs once, say so, then score each group the pipe brings until the pipe closes.

Messages are bytes with a one-byte tag. To the worker: a group (`reward_wire.encode_group`), or
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

from trainers_adapters.reward_spec import RewardSpec, build_specs
from trainers_adapters.reward_wire import decode_group, encode_scores

READY, SCORES, ERROR = b"R", b"S", b"E"


def error_message(error: BaseException) -> bytes:
    return json.dumps(
        {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    ).encode()


def run_reward_worker(specs: Sequence[RewardSpec], conn: Connection, index: int, torch_threads: int | None) -> None:
    """The worker process's main function."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s reward-worker-{index} %(levelname)s: %(message)s")
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        reward = build_specs(specs)
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
            images, prompts, metadata = decode_group(message)
            answer = SCORES + encode_scores(reward.score(images, prompts, metadata))
        except Exception as error:
            answer = ERROR + error_message(error)
        try:
            conn.send_bytes(answer)
        except (BrokenPipeError, OSError):
            return
