"""How the buckets of `update_weights` reach the workers: written once into their staging buffers,
double-buffered.

For each bucket the engine reserves a staging buffer on every rank (one RPC), then writes the
caller's tensors into the first rank's buffer on a writer thread (the NaN/inf check on the bytes
just written; every further rank gets one flat copy of it), and only then asks the ranks to stage
it. While bucket k is written, the caller's iterator produces bucket k+1 and the ranks stage
bucket k-1: packing overlaps sending. The last bucket is written on the caller's thread, as
nothing is left to overlap with it. A caller's tensors must stay as they are until
`update_weights` returns (the engine keeps none of them after that); an iterator that refills
one buffer in place for every bucket would need two.

Where a worker's buffer cannot be reached from here (a Ray actor on another host, a full
/dev/shm), the bucket is written into one flat buffer of the engine's and goes through the
executor's transport instead (`Worker.stage_weights_flat`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rollout.weights.handed_over import HandedOver
from rollout.weights.staging import BucketLayout, EngineMaps, StagingHandle, write_bucket
from rollout.worker.worker import Worker


@dataclass
class BucketInFlight:
    """A bucket being written into `targets` (the first rank's buffer first, checked there):
    `written` resolves to its NaN/inf problems."""

    layout: BucketLayout
    targets: list[torch.Tensor]
    written: Future
    through_transport: bool  # the targets are the engine's own buffer, sent through the transport
    paths: set[str] = field(default_factory=set)  # the workers' shared files it is written into


class BucketSender:
    """`in_process`: the workers share this process's memory (`uni`), so their staging buffers
    come back as tensors rather than files to map."""

    def __init__(self, collective_rpc: Callable, in_process: bool):
        self._rpc = collective_rpc
        self._in_process = in_process
        self._maps = EngineMaps()
        self._recent_paths: deque[set[str]] = deque(maxlen=2)  # the files the last two pushes wrote
        self._reachable = True  # False once a worker's shared file could not be mapped here
        self._ahead: deque[list[StagingHandle]] = deque()  # per bucket still to come: every rank's buffer

    def reserve_ahead(self, sizes: list[int]) -> None:
        """Reserve the buffers of the push's next buckets (`sizes`: their bytes) in one RPC."""
        if self._reachable and sizes:
            reserve = (sizes, not self._in_process, self._in_process)
            per_rank = self._rpc(Worker.reserve_staging, args=reserve)
            self._ahead.extend([list(handles) for handles in zip(*per_rank, strict=True)])

    def begin(
        self,
        layout: BucketLayout,
        tensors: list[torch.Tensor],
        check_finite: bool,
        writer: ThreadPoolExecutor | None,
        checker: ThreadPoolExecutor | None = None,
    ) -> BucketInFlight:
        """Reserve the bucket's staging buffer on every rank and write it on `writer` (here, when
        None: the last bucket, which nothing is left to overlap with), its NaN/inf check on
        `checker` beside the copy (`write_bucket`)."""
        targets, paths = [], set()
        if self._reachable:
            if self._ahead:
                handles = self._ahead.popleft()  # the worker checks it is this bucket's size
            else:
                reserve = ([layout.nbytes], not self._in_process, self._in_process)
                handles = [answer[0] for answer in self._rpc(Worker.reserve_staging, args=reserve)]
            targets = [self._maps.writable(handle) for handle in handles]
            paths = {h.path for h in handles if h.path is not None}
        through_transport = not targets or any(target is None for target in targets)
        if through_transport:  # another host or a full /dev/shm
            self._reachable = False
            targets, paths = [torch.empty(layout.nbytes, dtype=torch.uint8)], set()
        if writer is not None:
            written = writer.submit(write_bucket, targets, layout, tensors, check_finite, checker)
        else:
            written = Future()
            written.set_result(write_bucket(targets, layout, tensors, check_finite, checker))
        return BucketInFlight(layout, targets, written, through_transport, paths)

    def send(self, component: str, bucket: BucketInFlight, stage: bool) -> list[str]:
        """Wait for `bucket`'s write, then stage it on every rank if `stage` (the push is not
        refused already) and it holds no NaN or infinity (its problems are returned: the push is
        refused, and its rollback gives the reservations up)."""
        problems = bucket.written.result()
        if problems or not stage:
            return problems
        if bucket.through_transport:
            flat = HandedOver(bucket.targets[0])
            self._rpc(Worker.stage_weights_flat, args=(component, bucket.layout, flat))
        else:
            self._rpc(Worker.stage_weights_from_staging, args=(component, bucket.layout))
        return []

    def ended(self, paths: set[str]) -> None:
        """A push ended: keep the mappings of the files it and the push before wrote (the workers
        hand those out again), drop the rest."""
        self._ahead.clear()
        self._recent_paths.append(paths)
        self._maps.keep_only(set().union(*self._recent_paths))
