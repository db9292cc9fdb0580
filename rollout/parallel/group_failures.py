"""What a rank of a replica group does when its step fails: find out whether the group failed with it.

Every rank of a group runs the same batch through the same collectives. A step that fails the same
way on every rank (a request the model cannot take fails before or inside the forward on each) keeps
the group in step: each rank drops the same requests, or re-runs the batch's rows one by one in the
same order, and the collectives of those re-runs meet. A step that fails on one rank only (its own
device or memory, a fault injected on it) does not: its peers wait in a collective it left, or moved
their requests on while it did not, and re-running rows alone there would meet their collectives out
of step (sizes that do not match, or worse, that do). Such a rank must not go on; it raises
`GroupOutOfStep`, and the executor, seeing one rank of a group fail its step, stops the engine
(`executors.base`) instead of waiting for peers that may never answer.

The ranks tell failure from failure through their group's store (the `FileStore` they met at), not
through a collective: a peer stuck in the model's collective could never join one. A failing rank
posts what failed and waits a short grace for every peer to post the same; ranks that fail the same
step fail at the same point of the same computation, kept in step by the collectives before it.
"""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist

logger = logging.getLogger(__name__)

# How long a failing rank waits for its peers to report the same failure. Ranks are in step up to
# their last collective, so peers that fail together report within milliseconds of each other; a
# peer that has not reported after this is stuck in a collective or went on without failing.
FAILURE_GRACE_S = 5.0


class GroupOutOfStep(RuntimeError):
    """A rank's step failed where its group's other ranks did not fail with it: the group's ranks
    no longer run the same collectives on the same requests, and the engine must be rebuilt."""


class FailureAgreement:
    """One rank's side of the group's failure reports: the n-th failure of every rank is the same
    step on every rank while the group is in step, so reports are keyed by that count."""

    def __init__(self, store: dist.Store, local_rank: int, size: int, grace_s: float = FAILURE_GRACE_S):
        self.store = store
        self.local_rank = local_rank
        self.size = size
        self.grace_s = grace_s
        self.failures = 0

    def all_failed(self, what: str) -> bool:
        """Report that this rank's step failed with `what` (the stage that failed, the same text on
        every rank for the same failure); whether every peer reports the same within the grace."""
        key = f"step-failure/{self.failures}"
        self.failures += 1
        self.store.set(f"{key}/{self.local_rank}", what)
        peers = [f"{key}/{rank}" for rank in range(self.size) if rank != self.local_rank]
        try:
            self.store.wait(peers, datetime.timedelta(seconds=self.grace_s))
        except RuntimeError:  # the store's wait timed out: some peer did not fail
            return False
        return all(self.store.get(peer).decode() == what for peer in peers)
