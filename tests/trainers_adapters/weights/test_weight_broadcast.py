"""A trainer in another process pushes weights to the engine's worker processes over gloo."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from trainers_adapters.weights.checksum import weights_checksum

pytestmark = pytest.mark.timeout(180)


def _trainer(model: str, port: int, world_size: int, conn) -> None:
    """A trainer process: its own copy of the transformer, one optimizer-like change, then a push."""
    from rollout.pipelines.loading import load_adapter
    from rollout.weights.state import base_state
    from trainers_adapters.weights.broadcast import WeightBroadcaster

    transformer = load_adapter(model).transformer
    broadcaster = WeightBroadcaster("127.0.0.1", port, world_size)  # waits for the workers
    with torch.no_grad():
        for parameter in transformer.parameters():
            parameter.mul_(0.9)
    state = {name: t.detach() for name, t in base_state(transformer).items()}
    conn.send(([(n, t.dtype, tuple(t.shape)) for n, t in state.items()], weights_checksum(transformer)))
    conn.recv()  # the engine is receiving
    broadcaster.broadcast(state, bucket_bytes=64 * 1024)
    conn.recv()


@pytest.mark.slow  # repetition for the default suite: CI runs it (make test-slow)
def test_trainer_process_broadcasts_to_worker_processes(tiny_model):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    with RolloutEngine(EngineConfig(model=tiny_model, executor="mp", num_workers=2)) as engine:
        trainer = context.Process(target=_trainer, args=(tiny_model, port, 3, there), daemon=True)
        trainer.start()
        try:
            assert engine.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=3) == [1, 2]
            layout, trainer_digest = here.recv()
            names, dtypes, shapes = zip(*layout, strict=True)
            assert engine.weights_checksum() != trainer_digest
            here.send("go")
            version = engine.update_weights_from_distributed(
                list(names), list(dtypes), list(shapes), bucket_bytes=64 * 1024
            )
            assert version == 1
            assert engine.weights_checksum() == trainer_digest
            here.send("done")
        finally:
            trainer.join(30)
            trainer.kill()
    assert trainer.exitcode == 0


def test_group_ranks_must_leave_rank_zero_to_the_trainer(engine):
    with pytest.raises(ValueError, match="rank 0 for the trainer; got rank_offset=0"):
        engine.init_weight_update_group("127.0.0.1", 1, rank_offset=0, world_size=2)
