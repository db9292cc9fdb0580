"""Step-level batching: which requests each worker denoises in the next engine step.

Requests join and leave the running set at step boundaries (continuous batching). A batch holds
requests of one latent shape and adapter; their step indices, guidance scales, noise levels,
samplers and step counts may all differ, so one long request never blocks others. When a rank runs
requests of several shapes, it serves the least recently stepped group first.
"""

from __future__ import annotations

import time

from rollout.engine.request import Request, RequestStatus
from rollout.messages import Fork, SchedulerOutput, WorkerInput
from rollout.node_id import NodeId


class Scheduler:
    """Owns the unfinished requests (the request table) and decides each step's work; each rank
    steps at most `max_batch_size` at a time (fewer for a size whose requests say so:
    `Request.max_batch`). A rank here is a replica: with sequence parallel, one
    replica spans several worker ranks, which the executor gives the same work (`num_ranks` is
    `EngineConfig.num_replicas`).

    A request that reaches a branch step is replaced by its children on its rank (the worker holds
    its latents). Admission reserves a request's leaves, so a rank takes a tree only when its
    leaves fit (or when the rank is idle: a tree wider than a batch still runs, in turns).

    The table is indexed by request, group and ancestor id, so adding, finding and removing a
    request costs the same with 10 or 10,000 queued.
    """

    def __init__(self, num_ranks: int, max_batch_size: int):
        self.num_ranks = num_ranks
        self.max_batch_size = max_batch_size
        self.requests: dict[str, Request] = {}  # every unfinished request, oldest first
        self.waiting: dict[str, Request] = {}  # not admitted yet, first come first served
        self.running: dict[str, Request] = {}
        self._by_group: dict[str, dict[str, None]] = {}  # group id -> ids of its live requests
        self._by_ancestor: dict[str, dict[str, None]] = {}  # id a path branched from -> live ids below it
        self._pending_frees: dict[int, list[str]] = {rank: [] for rank in range(num_ranks)}
        self._tick = 0

    # The request table.

    def add(self, request: Request) -> None:
        self._insert(request)
        self.waiting[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def is_live_id(self, request_id: str) -> bool:
        """Whether `request_id` names an unfinished request, or a path some unfinished ones branched from."""
        return request_id in self.requests or request_id in self._by_ancestor

    def is_live_group(self, group_id: str) -> bool:
        return group_id in self._by_group

    def matching(self, target: str) -> list[Request]:
        """The unfinished requests that `target` names whole: its own id, its group's, or an id it
        branched from; oldest first."""
        if target in self.requests:
            return [self.requests[target]]
        ids = self._by_group.get(target) or self._by_ancestor.get(target) or {}
        return [self.requests[request_id] for request_id in ids]

    def future_parent(self, node: NodeId) -> Request | None:
        """The unfinished request that will branch into `node` (a branch or leaf it has not split
        into yet), or None."""
        for ancestor in reversed(node.ancestors):  # the nearest live one is its only candidate
            request = self.requests.get(str(ancestor))
            if request is not None:
                return request if request.has_descendant(node) else None
        return None

    def _insert(self, request: Request) -> None:
        request_id = request.request_id
        self.requests[request_id] = request
        self._by_group.setdefault(request.group_id, {})[request_id] = None
        for ancestor in request.ancestors:
            self._by_ancestor.setdefault(ancestor, {})[request_id] = None

    def _remove(self, request_id: str) -> Request:
        request = self.requests.pop(request_id)
        _discard(self._by_group, request.group_id, request_id)
        for ancestor in request.ancestors:
            _discard(self._by_ancestor, ancestor, request_id)
        return request

    # Steps.

    def schedule(self, admit: bool = True, encoder_generation: int = 0) -> SchedulerOutput:
        """The next step's work; `admit=False` leaves waiting requests queued (only running ones step).
        `encoder_generation` names the weights the text encoders have now: what new requests are
        encoded with, and what a worker's cached embeddings must match to be reused."""
        if admit:
            self._admit_waiting()
        inputs = {
            rank: WorkerInput(free_ids=ids, encoder_generation=encoder_generation)
            for rank, ids in self._pending_frees.items()
        }
        self._pending_frees = {rank: [] for rank in range(self.num_ranks)}
        for parent in [request for request in self.running.values() if request.branches_now]:
            self._branch(parent, inputs[parent.rank])
        for rank, work in inputs.items():
            for request in self._next_batch(rank):
                self._start(request, work)
                request.last_scheduled_tick = self._tick
                request.steps_done += 1
                work.step_ids.append(request.request_id)
        self._tick += 1
        return SchedulerOutput(worker_inputs=inputs)

    def _start(self, request: Request, work: WorkerInput) -> None:
        """Send a request's full data with its first step (or its first fork)."""
        if not request.sent_to_worker:
            work.new_requests.append(request.new_request_data())
            request.sent_to_worker = True
            request.first_step_time = time.monotonic()
            request.encoder_generation = work.encoder_generation

    def _branch(self, parent: Request, work: WorkerInput) -> list[Request]:
        """Replace `parent` by its children on its rank."""
        self._start(parent, work)
        children = parent.children()
        del self.running[parent.request_id]
        self._remove(parent.request_id)
        parent.status = RequestStatus.FINISHED
        for child in children:
            self._insert(child)
            self.running[child.request_id] = child
        work.forks.append(Fork(parent.request_id, tuple((child.request_id, child.seed) for child in children)))
        return children

    def take_frees(self) -> SchedulerOutput:
        """A step that only drops the state of aborted requests (no denoising)."""
        inputs = {rank: WorkerInput(free_ids=ids) for rank, ids in self._pending_frees.items()}
        self._pending_frees = {rank: [] for rank in range(self.num_ranks)}
        return SchedulerOutput(worker_inputs=inputs)

    def finish(self, request_id: str) -> Request:
        del self.running[request_id]
        request = self._remove(request_id)
        request.status = RequestStatus.FINISHED
        return request

    def abort(self, request_id: str) -> Request | None:
        """Remove a request; its worker state is freed with the next schedule. None if unknown."""
        if request_id not in self.requests:
            return None
        request = self._remove(request_id)
        self.running.pop(request_id, None)
        self.waiting.pop(request_id, None)
        if request.sent_to_worker:
            self._pending_frees[request.rank].append(request_id)
        request.status = RequestStatus.ABORTED
        return request

    def abort_all(self) -> list[Request]:
        """Remove every request, and forget their worker state (the workers are gone)."""
        lost = list(self.requests.values())
        for request in lost:
            request.status = RequestStatus.ABORTED
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        self._by_group.clear()
        self._by_ancestor.clear()
        self._pending_frees = {rank: [] for rank in range(self.num_ranks)}
        return lost

    def _admit_waiting(self) -> None:
        """Move waiting requests (first come, first served) to the rank with the most free slots."""
        load = [0] * self.num_ranks
        for request in self.running.values():
            load[request.rank] += request.slots
        while self.waiting:
            rank = min(range(self.num_ranks), key=load.__getitem__)
            request = next(iter(self.waiting.values()))
            if load[rank] and load[rank] + request.slots > self.max_batch_size:
                return
            del self.waiting[request.request_id]
            request.status = RequestStatus.RUNNING
            request.rank = rank
            request.last_scheduled_tick = self._tick  # newcomers queue behind requests already stepped
            self.running[request.request_id] = request
            load[rank] += request.slots

    def _next_batch(self, rank: int) -> list[Request]:
        candidates = [r for r in self.running.values() if r.rank == rank]
        if not candidates:
            return []
        key = min(candidates, key=lambda r: r.last_scheduled_tick).batch_key
        batch = [r for r in candidates if r.batch_key == key]
        # A size whose units of work fit the step timeout only a few samples at a time gets smaller batches.
        most = min(self.max_batch_size, *(r.max_batch for r in batch))
        if len(batch) > most:  # a tree wider than a batch: the least recently (and least) stepped go first
            turns = sorted(batch, key=lambda r: (r.last_scheduled_tick, r.steps_done))
            chosen = {id(r) for r in turns[:most]}
            batch = [r for r in batch if id(r) in chosen]
        return batch


def _discard(index: dict[str, dict[str, None]], key: str, request_id: str) -> None:
    ids = index[key]
    del ids[request_id]
    if not ids:
        del index[key]
