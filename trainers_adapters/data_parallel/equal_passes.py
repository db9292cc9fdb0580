"""The micro-batches a rank runs when every forward is collective.

A sharded policy (`FullPolicy`: FSDP gathers each unit's weights from every rank in the forward and
reduces its gradients in the backward) needs every rank to run as many forwards and backwards as
the others, but a rank trains only on the samples it holds, which a minibatch may give it fewer
of. It runs zero-weight passes of a filler micro-batch (one of its own samples) until it has run as
many as the rank with most: the same collectives, no gradient or statistic from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from trainers_adapters.data_parallel.trainer_ranks import TrainerRanks

Chunk = TypeVar("Chunk")


def equal_passes(
    ranks: TrainerRanks, chunks: Sequence[Chunk], filler: Chunk, sharded: bool
) -> list[tuple[Chunk, bool]]:
    """(micro-batch, whether it counts) for this rank: its `chunks`, then for a `sharded` policy
    `filler` with False until every rank runs as many; without sharding, the chunks alone."""
    passes = [(chunk, True) for chunk in chunks]
    if sharded:
        most = int(ranks.max(float(len(chunks))))
        passes += [(filler, False)] * (most - len(chunks))
    return passes
