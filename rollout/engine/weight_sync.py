"""The engine's side of `update_weights`: check, stream in buckets, apply on every rank or on none.

1. Every tensor is checked against the component's names, shapes and dtypes (and for NaN/inf with
   `check_finite`) as it streams past; checked tensors are staged on every rank in buckets of about
   `bucket_bytes`. Staged tensors are invisible to sampling. Tensors the workers read themselves
   (files, a broadcast) have their headers checked here and their values on the workers; those a
   user's worker function reads from its own source (`push_from_function`) are checked there whole.
2. If anything was wrong, the staged tensors are dropped and one error lists every offending name.
3. Otherwise every rank swaps its staged tensors in. If any rank fails (or does not answer), every
   rank rolls back; a rollback that fails too, or a commit that fails on some rank, leaves ranks
   that may disagree, so the engine stops with `EngineDeadError` naming the original error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from rollout.engine.bucket_sender import BucketInFlight, BucketSender
from rollout.errors import EngineDeadError, WorkerError
from rollout.weights.broadcast_group import BroadcastEntry, plan_buckets
from rollout.weights.delta import Fingerprint, PushReport, fingerprint
from rollout.weights.handed_over import HandedOver
from rollout.weights.safetensors_files import read_specs
from rollout.weights.staging import BucketLayout
from rollout.weights.state import TensorSpec, all_finite, non_finite_problems, refusal_message, spec_problem
from rollout.worker.worker import Worker


class WeightSync:
    """`in_process`: the workers share this process's memory (`uni`): their staging buffers come
    back as tensors, not as shared files to map."""

    def __init__(self, collective_rpc: Callable, in_process: bool):
        self._rpc = collective_rpc
        self._in_process = in_process
        self.sender = BucketSender(collective_rpc, in_process)
        self.applied: StagedPush | None = None  # set by the `StagedPush` that applied last
        self._specs: dict[str, dict[str, TensorSpec]] = {}
        self._repeat_refusal: Callable[[], Exception] | None = None  # set by `only_if_unchanged`

    @contextmanager
    def only_if_unchanged(self, refusal: Callable[[], Exception]):
        """Pushes in the block are staged and checked as usual, then dropped, not applied: where
        every rank staged exactly the weights it holds (a re-push of them) that changes nothing;
        otherwise the push is refused with `refusal()` (a push that names the current version)."""
        self._repeat_refusal = refusal
        try:
            yield
        finally:
            self._repeat_refusal = None

    def specs(self, component: str) -> dict[str, TensorSpec]:
        if component not in self._specs:
            self._specs[component] = self._rpc(Worker.weight_specs, args=(component,), ranks=[0])[0]
        return self._specs[component]

    def push(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        component: str,
        check_finite: bool,
        bucket_bytes: int,
        baseline: dict[str, Fingerprint] | None = None,
    ) -> int:
        """Apply the update on every rank; returns the number of tensors. Raises ValueError (nothing
        changed) for a bad update, WorkerError (rolled back everywhere) if a rank failed. The buckets
        of a `HandedOver` update are handed over to the ranks in turn. With a `baseline` (a delta
        push: the fingerprints of what every rank holds), only the tensors whose fingerprint
        differs are sent; the push, once applied, is `applied` (its `report`, its `fingerprints`)."""
        staged = self.open(component, check_finite, bucket_bytes, baseline)
        try:
            staged.add(named_tensors)
        except BaseException as error:
            staged.abort(error)
            raise
        return staged.finish()

    def open(
        self, component: str, check_finite: bool, bucket_bytes: int, baseline: dict[str, Fingerprint] | None = None
    ) -> StagedPush:
        """An update to stage in parts (`StagedPush`); `push` is one whose parts come in one call."""
        return StagedPush(self, component, check_finite, bucket_bytes, baseline)

    def _stage_handed_over(self, component: str, bucket: dict[str, torch.Tensor], check_finite: bool) -> list[str]:
        """Stage tensors handed over to an in-process worker as they are (no copy); returns the
        NaN/inf problems found (nothing is staged then)."""
        problems = non_finite_problems(bucket) if check_finite else []
        if not problems:
            self._rpc(Worker.stage_weights, args=(component, HandedOver(bucket)))
        return problems

    def push_from_files(self, files: list[Path], component: str, check_finite: bool) -> int:
        """Like `push`, but every rank reads the safetensors `files` itself; the headers are
        checked here first, the values (with `check_finite`) on the ranks."""
        given = read_specs(files)
        self.check_specs(given, component, name_foreign=False)
        with self._all_or_nothing(component):
            self._stage_on_ranks(Worker.stage_weights_from_files, component, [str(f) for f in files], check_finite)
        return len(given)

    def push_from_broadcast(
        self, entries: list[BroadcastEntry], component: str, bucket_bytes: int, check_finite: bool
    ) -> int:
        """Like `push`, but the tensors arrive through the trainer's broadcast group; the names,
        shapes and dtypes announced in `entries` are checked here first, the values (with
        `check_finite`) on the ranks once received."""
        self.check_specs({e.name: e.spec for e in entries}, component)
        with self._all_or_nothing(component):
            buckets = plan_buckets(entries, bucket_bytes)
            self._stage_on_ranks(Worker.stage_weights_from_broadcast, component, buckets, check_finite)
        return len(entries)

    def push_from_function(self, method: str, args: tuple, kwargs: dict, component: str, check_finite: bool) -> int:
        """Like `push`, but every rank stages what its `@stages_weights` function `method` returns
        (`Worker.stage_weights_from_function`), checked there. A function that fails or is refused
        on any rank, or ranks that stage different numbers of tensors, roll every rank back."""
        with self._all_or_nothing(component):
            staging = Worker.stage_weights_from_function
            counts = self._stage_on_ranks(staging, component, method, args, kwargs, check_finite)
            if len(set(counts)) > 1:
                raise ValueError(
                    f"update refused, weights unchanged: the ranks' {method!r} staged different numbers of tensors "
                    f"of {component} ({counts}, in rank order); every rank must stage the same update"
                )
        return counts[0]

    def _stage_on_ranks(self, method: Callable, *args) -> list:
        """Run a staging worker function (its result on every rank); a rank's refusal
        (ValueError) is the update's refusal."""
        try:
            return self._rpc(method, args=args)
        except WorkerError as error:
            if error.raised(ValueError):
                raise ValueError(error.message) from error
            raise

    def check_specs(self, given: Mapping[str, TensorSpec], component: str, name_foreign: bool = True) -> None:
        """Raise ValueError listing every name that is unknown or has the wrong shape or dtype.
        `name_foreign=False` (files the workers read: any file this process may read, named by a
        client that may not) counts the names that are not the component's without listing them."""
        specs = self.specs(component)
        problems = [
            problem
            for name, spec in given.items()
            if (name_foreign or name in specs) and (problem := spec_problem(name, specs.get(name), spec))
        ]
        foreign = 0 if name_foreign else sum(name not in specs for name in given)
        if foreign:
            problems.append(
                f"{foreign} of the {len(given)} tensors are not weights of this component (their names are not "
                "shown: the files are read where the engine runs, perhaps by someone who may not read them; "
                "list them there with safetensors.safe_open(path, 'pt').keys())"
            )
        _raise_if_refused(component, problems, given)

    @contextmanager
    def _all_or_nothing(self, component: str):
        """Stage in the block, then swap in on every rank and commit. Whatever goes wrong before the
        commit (a refused update, a rank failing to apply) rolls every rank back."""
        try:
            yield
        except BaseException as error:
            self._roll_back(component, error)
            raise
        self._apply(component)

    def _apply(self, component: str) -> None:
        """Swap the staged tensors in on every rank and commit; a failure before the commit rolls
        every rank back. Inside `only_if_unchanged`, drop them instead (refused unless unchanged)."""
        if self._repeat_refusal is not None:
            unchanged = all(self._rpc(Worker.staged_weights_are_live, args=(component,)))
            refusal = None if unchanged else self._repeat_refusal()
            self._roll_back(component, refusal or ValueError("a repeated push, dropped"))
            if refusal is not None:
                raise refusal
            return
        try:
            self._rpc(Worker.apply_staged_weights, args=(component,))
        except BaseException as error:
            self._roll_back(component, error)
            raise
        try:
            self._rpc(Worker.commit_weights, args=(component,))
        except (WorkerError, TimeoutError) as error:
            raise EngineDeadError(
                f"committing the update of {component} failed on some rank ({_brief(error)}); ranks that "
                "committed and ranks that did not may now hold different weights: create a new engine"
            ) from error

    def _roll_back(self, component: str, cause: BaseException) -> None:
        try:
            self._rpc(Worker.rollback_weights, args=(component,))
        except Exception as error:
            raise EngineDeadError(
                f"the update of {component} failed ({_brief(cause)}) and rolling it back failed too "
                f"({_brief(error)}); ranks may hold different weights: create a new engine"
            ) from cause


def _brief(error: BaseException) -> str:
    """One line for an error: a worker's own exception, or the local one (tracebacks stay chained)."""
    if isinstance(error, WorkerError):
        return f"rank {error.rank}: {error.error}"
    return f"{type(error).__name__}: {error}"


def _raise_if_refused(component: str, problems: list[str], names) -> None:
    if not names:
        problems = ["the update holds no tensors", *problems]
    if problems:
        raise ValueError(refusal_message(component, problems))


class StagedPush:
    """One update staged in parts: `add` checks (name, tensor) pairs and stages them on every rank
    in buckets of about `bucket_bytes`, as many calls as it takes; `finish` applies the update on
    every rank or on none (raising as `WeightSync.push` does); `abort` drops what was staged. The
    engine may step between the calls: staged tensors are invisible to sampling (the HTTP server's
    streamed push stages each bucket as it arrives, and generation goes on meanwhile)."""

    def __init__(
        self,
        sync: WeightSync,
        component: str,
        check_finite: bool,
        bucket_bytes: int,
        baseline: dict[str, Fingerprint] | None = None,
    ):
        self.component = component
        self.baseline = baseline  # a delta push: tensors with these fingerprints are not sent
        self.fingerprints: dict[str, Fingerprint] = {}  # of every tensor given, in a delta push
        self.report: PushReport | None = None  # once applied
        self._given_bytes = self._sent_bytes = self._sent_tensors = 0
        self._sync, self._check_finite, self._bucket_bytes = sync, check_finite, bucket_bytes
        self._specs = sync.specs(component)
        self._problems: list[str] = []
        self._seen: set[str] = set()
        self._checked_ahead: dict[str, torch.Tensor] = {}  # tensors whose name, shape and dtype fit, by name
        self._bucket: list[tuple[str, torch.Tensor]] = []
        self._bucket_size = 0
        self._paths: set[str] = set()  # the workers' shared files written
        self._in_flight: BucketInFlight | None = None  # the bucket being written, staged once the next starts
        self._writer: ThreadPoolExecutor | None = None  # writes the buckets, beside the caller's iterator
        self._checker: ThreadPoolExecutor | None = None  # sums what the write just copied, beside it
        self._handed_over = False
        self.ended = False  # applied, refused or dropped: nothing of it is staged any more

    def add(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check the pairs and stage every full bucket; those of a `HandedOver` are handed over."""
        self._handed_over = isinstance(named_tensors, HandedOver)
        named_tensors = named_tensors.value if self._handed_over else named_tensors
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if isinstance(named_tensors, Mapping) and not self._seen and self.baseline is None:
            self._reserve_ahead(named_tensors)
        for name, tensor in items:
            if name in self._seen:
                self._problems.append(f"{name}: given twice")
                continue
            self._seen.add(name)
            expected = self._specs.get(name)
            checked = self._checked_ahead.get(name) is tensor  # by `_reserve_ahead`: fits
            problem = None if checked else spec_problem(name, expected, TensorSpec(tuple(tensor.shape), tensor.dtype))
            if problem is not None:
                self._check_values(self._bucket)  # refused: what waits for its bucket is only checked
                self._bucket, self._bucket_size = [], 0
                self._problems.append(problem)
            elif self._problems:  # once refused, only keep checking
                self._check_values([(name, tensor)])
            else:  # values checked as they are written into the staging buffers
                self._given_bytes += expected.nbytes
                if self.baseline is not None:
                    mark = self.fingerprints[name] = fingerprint(tensor)
                    if self.baseline.get(name) == mark:
                        continue  # every rank holds it already
                self._sent_tensors += 1
                self._sent_bytes += expected.nbytes
                self._bucket.append((name, tensor))
                self._bucket_size += expected.nbytes
                if self._bucket_size >= self._bucket_bytes:
                    self._stage_bucket()

    def finish(self) -> int:
        """Apply on every rank; returns the number of tensors. A refused update is dropped first."""
        try:
            if self._bucket and not self._problems:
                self._stage_bucket(last=True)  # its values are checked as it is written
            self._send_in_flight()
            _raise_if_refused(self.component, self._problems, self._seen)
        except BaseException as error:
            self.abort(error)
            raise
        self._end()
        self._sync._apply(self.component)
        self.report = PushReport(
            len(self._seen), self._given_bytes, self._sent_tensors, self._sent_bytes, self.baseline is not None
        )
        self._sync.applied = self
        return len(self._seen)

    def abort(self, cause: BaseException) -> None:
        """Drop what was staged on every rank (`cause`: why, for the error if that fails too)."""
        self._bucket.clear()
        if self._in_flight is not None:  # its write must end before the rollback gives its buffers up
            self._in_flight.written.exception()
            self._in_flight = None
        self._end()
        self._sync._roll_back(self.component, cause)

    def _end(self) -> None:
        self.ended = True
        self._checked_ahead.clear()  # the caller's tensors: none is kept after the push
        for pool in (self._writer, self._checker):
            if pool is not None:
                pool.shutdown()
        self._writer = self._checker = None
        self._sync.sender.ended(self._paths)

    def _reserve_ahead(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """A whole update given at once: reserve every bucket's staging buffer in one RPC (a
        delta push learns only as it goes which tensors it sends)."""
        if self._handed_over and self._sync._in_process:
            return
        sizes, bucket, size = [], [], 0
        for name, tensor in named_tensors.items():  # bucketed as `add` buckets them
            expected = self._specs.get(name)
            if spec_problem(name, expected, TensorSpec(tuple(tensor.shape), tensor.dtype)) is not None:
                self._checked_ahead.clear()
                return  # refused as it is added: nothing to reserve
            self._checked_ahead[name] = tensor
            bucket.append((name, expected))
            size += expected.nbytes
            if size >= self._bucket_bytes:
                sizes.append(BucketLayout.of(bucket).nbytes)
                bucket, size = [], 0
        if bucket:
            sizes.append(BucketLayout.of(bucket).nbytes)
        self._sync.sender.reserve_ahead(sizes)

    def _check_values(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        if self._check_finite:
            self._problems += [f"{name}: holds NaN or infinite values" for name, t in pairs if not all_finite(t)]

    def _stage_bucket(self, last: bool = False) -> None:
        """Start writing the full bucket, then stage the one written before it (double buffering);
        the `last` is written on this thread."""
        bucket, self._bucket, self._bucket_size = self._bucket, [], 0
        if self._handed_over and self._sync._in_process:
            self._send_in_flight()
            self._problems += self._sync._stage_handed_over(self.component, dict(bucket), self._check_finite)
            return
        layout = BucketLayout.of([(name, self._specs[name]) for name, _ in bucket])
        if self._writer is None and not last:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-weight-writer")
        if self._checker is None and self._check_finite:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-weight-checker")
        if self._problems:  # refused already: only check the rest
            self._check_values(bucket)
            return
        previous = self._in_flight
        writer = None if last else self._writer
        tensors = [t for _, t in bucket]
        self._in_flight = self._sync.sender.begin(layout, tensors, self._check_finite, writer, self._checker)
        self._paths |= self._in_flight.paths
        if previous is not None:  # checked and staged while this one is written
            self._problems += self._sync.sender.send(self.component, previous, stage=not self._problems)

    def _send_in_flight(self) -> None:
        bucket, self._in_flight = self._in_flight, None
        if bucket is not None:
            self._problems += self._sync.sender.send(self.component, bucket, stage=not self._problems)
