"""The hot-swap API: weights, LoRA adapters, sleep and wake.

A `HotSwap` owns what the engine keeps of its workers' weights (the weight version, the loaded
adapters, the sleep level, the text encoders' generation) and changes it only through the workers.
It is built over the executor (the workers' class and the config) and the engine's `collective_rpc`,
and tested over fake ranks. It never calls the engine back: `RolloutEngine` sequences it. The engine
checks that it is open before it asks, finishes its running requests between the phases of a swap
that waits for them (`weight_update` then `apply_update`; `stage_lora` then `commit_lora`), passes
what a swap must know of its requests, and dies of the `EngineDeadError` a swap raises where ranks
may disagree. Every method is a thin layer over `collective_rpc` plus that bookkeeping, and runs
between engine steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollout.api import RolloutAPI, implements
from rollout.engine.weight_sync import StagedPush, WeightSync
from rollout.engine.weight_versions import WeightVersions
from rollout.errors import EngineDeadError, WorkerError
from rollout.weights.broadcast_group import BroadcastEntry
from rollout.weights.delta import Fingerprint, PushReport, SentRecord
from rollout.weights.safetensors_files import safetensors_files
from rollout.weights.state import TensorSpec
from rollout.worker.marks import staging_function
from rollout.worker.worker import Worker

if TYPE_CHECKING:
    from rollout.model_spec import ModelSpec

logger = logging.getLogger(__name__)

_LORA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
    """A weight update checked whole (component, version, mode, sleep, no push being staged) and
    not sent yet: `HotSwap.apply_update` sends it. With `mode` "wait" the engine first finishes its
    running requests on the old weights."""

    push: Callable[[], int]  # stages, checks and applies it on every rank (`WeightSync`)
    component: str
    version: int | None  # as the caller gave it
    new_version: int
    repeat: bool  # `version` names the current one: applied only if every rank holds it already
    mode: str


@dataclasses.dataclass(frozen=True)
class StagedLora:
    """A LoRA adapter staged on every rank beside the live one (`HotSwap.stage_lora`), which no rank
    has switched to yet: `HotSwap.commit_lora` switches, `HotSwap.drop_staged_lora` drops it. A
    `repeat` (every rank staged exactly its live adapter, under the current version) was dropped
    already: nothing changes."""

    name: str
    modules: int  # how many modules it binds
    version: int  # the weight version it gives
    repeat: bool


class HotSwap:
    """The engine's weights, adapters and sleep, over `executor` (its `worker_cls`, whose functions
    are checked before a call that names one sends anything, and its `config`), `model_spec` (a
    component a call names is checked with it before anything is sent) and the engine's
    `collective_rpc`."""

    # `executor`: the engine's `executors.Executor`, unannotated: rollout reaches executors only
    # through `get_executor_class`. `collective_rpc`: the engine's (`RolloutEngine.collective_rpc`),
    # not the executor's: it refuses once the engine is shut down or dead, a worker's death ends the
    # engine at once, and step observers see every worker call (benchmarks/weight_sync times a push
    # by them). A streamed push's `StagedPush.add` calls it outside any engine method, so guards put
    # around this class's methods would miss those calls.
    def __init__(self, executor, model_spec: ModelSpec, collective_rpc: Callable[..., list]):
        self.collective_rpc = collective_rpc
        self._check_component = model_spec.check_component
        self._worker_cls = executor.worker_cls
        self.config = executor.config
        self._weight_sync = WeightSync(self.collective_rpc, executor.shares_memory)
        self.versions = WeightVersions()
        self.sleep_level = 0
        # Counts the changes of the text encoders' weights; the engine sends it with every step, and
        # embeddings encoded at an older count are never reused.
        self.encoder_generation = 0
        self._loras: dict[str, int] = {}  # name -> modules it binds
        self._staged_push: StagedPush | None = None  # an update staged in parts, until it ends
        # What the last update_weights sent (its changed fraction), and per component the
        # fingerprints of what every rank holds, for delta pushes (rollout.weights.delta).
        self.last_push: PushReport | None = None
        self._sent: dict[str, SentRecord] = {}

    @property
    def weight_version(self) -> int:
        return self.versions.current

    def check_awake(self) -> None:
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (level {self.sleep_level}); call wake_up() before generating")

    def has_lora(self, name: str) -> bool:
        return name in self._loras

    # Weights.

    def weight_update(
        self, named_tensors, *, component, version, mode, check_finite, bucket_bytes, delta=False
    ) -> WeightUpdate:
        """`RolloutEngine.update_weights`, checked: replace weights of `component` on every worker,
        all at once, refused whole or applied whole."""
        self._check_component(component)
        _check_bucket_bytes(bucket_bytes)
        push_args = (named_tensors, component, check_finite, bucket_bytes, self._baseline(component, delta))
        return self._checked_update(self._weight_sync.push, push_args, component, version, mode)

    def open_weight_push(
        self, *, component: str, check_finite: bool, bucket_bytes: int, version: int | None, delta: bool = False
    ) -> StagedPush:
        """`RolloutEngine.open_weight_push`: `update_weights` in parts, whose version is checked now."""
        self.check_awake()
        _check_bucket_bytes(bucket_bytes)
        if not self.versions.names_current(version):  # the current one only repeats: checked at the end
            self.versions.next(version)
        self._check_no_staged_push()
        baseline = self._baseline(component, delta)
        self._staged_push = self._weight_sync.open(component, check_finite, bucket_bytes, baseline)
        return self._staged_push

    def _baseline(self, component: str, delta: bool) -> dict[str, Fingerprint] | None:
        """What a delta push compares with: the fingerprints sent under the version every rank
        holds now (none, and so every tensor sent, after any other update or a sleep); None for a
        full push."""
        if not delta:
            return None
        record = self._sent.get(component)
        return dict(record.fingerprints) if record is not None and record.version == self.versions.current else {}

    def finishing_update(self, push: StagedPush, *, version: int | None, mode: str) -> WeightUpdate:
        """The update that applies a push opened with `open_weight_push`, checked as `weight_update`
        checks its own (`RolloutEngine.finish_weight_push`); the push is no longer the open one.
        Refused here or later before the push's own finish, it is dropped with `abort_weight_push`."""
        self._staged_push = None
        return self._checked_update(push.finish, (), push.component, version, mode)

    def abort_weight_push(self, push: StagedPush, cause: BaseException) -> None:
        """Drop what an update opened with `open_weight_push` staged (its body failed, or its finish
        was refused before the push's own)."""
        if self._staged_push is push:
            self._staged_push = None
        if not push.ended:
            push.abort(cause)

    def _check_no_staged_push(self) -> None:
        if self._staged_push is not None:
            raise RuntimeError(
                f"a weight push of {self._staged_push.component} is being received and staged; "
                "send this once it has ended"
            )

    def _checked_update(
        self, push: Callable, push_args: tuple, component: str, version: int | None, mode: str
    ) -> WeightUpdate:
        self._check_no_staged_push()
        self.check_awake()
        if mode not in ("wait", "pause"):
            raise ValueError(f"mode must be 'wait' or 'pause', got {mode!r}")
        # The current version only for a push of the weights the engine holds (a resumed trainer
        # re-pushing its checkpoint), which changes nothing; any other version checked before staging.
        repeat = self.versions.names_current(version)
        new_version = self.versions.current if repeat else self.versions.next(version)
        return WeightUpdate(functools.partial(push, *push_args), component, version, new_version, repeat, mode)

    def apply_update(self, update: WeightUpdate) -> int:
        """Send a checked update to every rank; returns the new weight version. A failed commit or
        rollback leaves ranks that may disagree (`weight_sync` decides): EngineDeadError."""
        if update.repeat:
            with self._weight_sync.only_if_unchanged(lambda: self.versions.current_taken(update.version)):
                update.push()
            logger.debug(
                "weights of %s repeated at the current version %d: unchanged", update.component, update.version
            )
            return update.new_version
        self._weight_sync.applied = None
        update.push()
        self.encoder_generation += 1
        self.versions.move_to(update.new_version)
        applied, self.last_push = self._weight_sync.applied, None
        if applied is None:  # from files, a broadcast or a worker function
            logger.info("weights of %s updated to version %d", update.component, update.new_version)
            return update.new_version
        self.last_push = report = applied.report
        if applied.baseline is not None:
            self._sent[update.component] = SentRecord(update.new_version, applied.baseline | applied.fingerprints)
        logger.info(
            "weights of %s updated to version %d: %d of %d tensors sent (%.1f %% of %.1f MB%s)",
            update.component,
            update.new_version,
            report.sent_tensors,
            report.tensors,
            100 * report.changed_fraction,
            report.nbytes / 1e6,
            ", a delta push" if report.delta else "",
        )
        return update.new_version

    def weight_update_from_disk(self, path, *, component, version, mode, check_finite) -> WeightUpdate:
        """`weight_update` from a .safetensors file or a diffusers component folder: every worker
        reads the files itself. Names, shapes and dtypes are checked from the file headers first,
        the values (`check_finite`) by the workers as they read them."""
        self._check_component(component)
        files = safetensors_files(path)
        push_args = (files, component, check_finite)
        return self._checked_update(self._weight_sync.push_from_files, push_args, component, version, mode)

    def weight_update_from_worker(
        self, method, args, kwargs, *, component, version, mode, check_finite
    ) -> WeightUpdate:
        """`weight_update` of `RolloutEngine.update_weights_from_worker` (whose docstring says what
        it does): `method` must be a `@stages_weights` function of `worker_extension_cls`, checked
        here before anything is sent."""
        self._check_component(component)
        staging_function(self._worker_cls, method)
        push_args = (method, tuple(args), dict(kwargs or {}), component, check_finite)
        return self._checked_update(self._weight_sync.push_from_function, push_args, component, version, mode)

    @implements(RolloutAPI.init_weight_update_group)
    def init_weight_update_group(
        self, master_address, master_port, rank_offset, world_size, backend, timeout_s
    ) -> list[int]:
        """Join a trainer's broadcast group: worker r becomes group rank `rank_offset + r`; the
        trainer is rank 0 and hosts the store at master_address:master_port. Blocks until every
        rank has joined, so the trainer joins concurrently (see
        `trainers_adapters.weights.broadcast.WeightBroadcaster`). Returns the workers' group ranks."""
        if rank_offset < 1 or rank_offset + self.config.num_workers > world_size:
            raise ValueError(
                f"the workers need group ranks rank_offset..rank_offset+{self.config.num_workers - 1} inside "
                f"world_size={world_size}, with rank 0 for the trainer; got rank_offset={rank_offset}"
            )
        args = (master_address, master_port, rank_offset, world_size, backend, timeout_s)
        return self.collective_rpc(Worker.init_weight_update_group, args=args, timeout=timeout_s + 30)

    def weight_update_from_distributed(
        self, names, dtypes, shapes, *, component, version, mode, bucket_bytes, check_finite
    ) -> WeightUpdate:
        """`weight_update` whose tensors the trainer broadcasts through the group (in this order, in
        buckets of `bucket_bytes`) while `apply_update` waits; names, dtypes and shapes are checked
        first, the values (`check_finite`) by the workers once received."""
        self._check_component(component)
        _check_bucket_bytes(bucket_bytes)
        entries = _broadcast_entries(names, dtypes, shapes)
        push_args = (entries, component, bucket_bytes, check_finite)
        return self._checked_update(self._weight_sync.push_from_broadcast, push_args, component, version, mode)

    @implements(RolloutAPI.check_weight_update)
    def check_weight_update(self, names, dtypes, shapes, component) -> None:
        """Raise ValueError if an update with these tensors would be refused (a trainer checks before
        it broadcasts, so receivers are never left waiting for a refused update)."""
        self._check_component(component)
        entries = _broadcast_entries(names, dtypes, shapes)
        self._weight_sync.check_specs({e.name: e.spec for e in entries}, component)

    @implements(RolloutAPI.weights_checksum)
    def weights_checksum(self, component) -> str:
        """SHA-256 of every weight of `component`; raises if the ranks disagree."""
        self._check_component(component)
        self.check_awake()
        digests = self.collective_rpc(Worker.weights_checksum, args=(component,))
        if len(set(digests)) != 1:
            raise RuntimeError(f"ranks hold different weights of {component}: checksums {digests}")
        return digests[0]

    # LoRA adapters.

    def stage_lora(self, name, source, config, *, version, check_finite) -> StagedLora:
        """The first phase of `RolloutEngine.load_lora` (which says what the arguments are): check
        them and the version, and stage the adapter on every rank beside its live one (running
        requests keep theirs, so a refusal answers at once). A refusal or failure is rolled back on
        every rank and raised (ValueError for a refusal); a rollback that fails too leaves ranks
        that may disagree: EngineDeadError."""
        if not (isinstance(name, str) and _LORA_NAME.fullmatch(name)):
            raise ValueError(
                f"a LoRA name is 1-64 letters, digits, '_' or '-' (PEFT keys its layers by it), got {name!r}"
            )
        if isinstance(source, str | Path):
            source = str(source)
        elif not isinstance(source, Mapping):
            raise TypeError(f"LoRA source must be a folder path or a mapping of tensors, got {type(source).__name__}")
        elif config is None:
            raise ValueError(f"LoRA {name!r} from tensors needs a config (a peft.LoraConfig or its dict)")
        repeat = self.versions.names_current(version)  # allowed only to repeat the live adapter exactly
        new_version = self.versions.current if repeat else self.versions.next(version)
        # Only once every rank has staged it, and the engine's running requests are done, does any switch.
        kept = f"the {name!r} it had" if name in self._loras else f"no adapter named {name!r}"
        try:
            bound = self.collective_rpc(
                Worker.stage_lora,
                args=(name, source if isinstance(source, str) else dict(source), config, check_finite),
            )
            if repeat:
                self._drop_repeated_lora(name, version)
        except TimeoutError as error:
            self._roll_back_lora(name, error)
            raise TimeoutError(f"{error}; the load was rolled back on every rank, which keeps {kept}") from error
        except WorkerError as error:
            self._roll_back_lora(name, error)
            if error.raised(ValueError):  # refused by the checks
                raise ValueError(error.message) from error
            raise RuntimeError(
                f"loading LoRA {name!r} failed on rank {error.rank} ({error.error}); every rank keeps {kept}"
            ) from error
        return StagedLora(name, bound[0], new_version, repeat)

    def drop_staged_lora(self, staged: StagedLora) -> None:
        """Drop `staged` from every rank (the engine could not finish its running requests): best
        effort, since a dead engine refuses at once (its workers are gone with what they staged)."""
        with contextlib.suppress(Exception):
            self.collective_rpc(Worker.rollback_lora, args=(staged.name,))

    def commit_lora(self, staged: StagedLora) -> int:
        """Switch every rank to `staged` (the engine's running requests are done); returns the new
        weight version. A commit that fails unloads it everywhere (RuntimeError); if that fails too,
        ranks may disagree on what it is: EngineDeadError."""
        name = staged.name
        try:
            self.collective_rpc(Worker.commit_lora, args=(name,))
        except (TimeoutError, WorkerError) as error:
            # Some ranks may have switched: they must not disagree on what `name` means.
            self._loras.pop(name, None)
            try:
                self.collective_rpc(Worker.discard_lora, args=(name,))
            except (TimeoutError, WorkerError) as discard_error:
                why = f"committing LoRA {name!r} failed ({error}) and unloading it failed too ({discard_error})"
                raise EngineDeadError(f"{why}: ranks may disagree on what {name!r} is; create a new engine") from error
            raise RuntimeError(f"committing LoRA {name!r} failed ({error}); it is unloaded everywhere") from error
        self._loras[name] = staged.modules
        self.versions.move_to(staged.version)
        logger.debug("LoRA %r loaded on %d modules; weight version %d", name, staged.modules, staged.version)
        return staged.version

    def _drop_repeated_lora(self, name: str, version: int) -> None:
        """A load that names the current version, staged: it changes nothing if every rank staged
        exactly its live adapter `name` (a trainer resumed from a checkpoint re-pushing it to the
        server that held it), and is dropped; otherwise it is refused (ValueError), as any push that
        would give the current version other weights."""
        repeats = name in self._loras and all(self.collective_rpc(_stages_the_live_lora, args=(name,)))
        self.collective_rpc(Worker.rollback_lora, args=(name,))
        if not repeats:
            raise self.versions.current_taken(version)
        logger.debug("LoRA %r repeated under the current version %d: nothing changed", name, version)

    def _roll_back_lora(self, name: str, cause: BaseException) -> None:
        """Drop what any rank staged for `name` (a late stage still running in a worker is done
        before this runs there). A rollback that fails leaves ranks that may disagree: EngineDeadError."""
        wait = max(self.config.rpc_timeout_s, self.config.step_timeout_s)
        try:
            self.collective_rpc(Worker.rollback_lora, args=(name,), timeout=wait)
        except (TimeoutError, WorkerError) as error:
            raise self._dead_after("load_lora", f"rolling it back failed too ({error})") from cause

    def unload_lora(self, name: str, users: list[str]) -> None:
        """Remove adapter `name` from every worker and free its memory; refused while `users` (the
        engine's unfinished requests that use it, by id) is not empty."""
        if name not in self._loras:
            raise ValueError(f"no LoRA named {name!r} is loaded; loaded: {self.list_loras()}")
        if users:
            raise RuntimeError(f"{len(users)} unfinished requests use LoRA {name!r}; finish or abort them first")
        try:
            self.collective_rpc(Worker.unload_lora, args=(name,))
        except TimeoutError as error:
            raise self._reread_after("unload_lora", error) from error
        del self._loras[name]

    def lora_modules(self, name: str) -> int:
        """How many modules adapter `name` binds."""
        if name not in self._loras:
            raise ValueError(f"no LoRA named {name!r} is loaded; loaded: {self.list_loras()}")
        return self._loras[name]

    def list_loras(self) -> list[str]:
        """Names of the loaded LoRA adapters."""
        return sorted(self._loras)

    # Memory.

    def sleep(self, level: int, unfinished: int) -> None:
        """`RolloutEngine.sleep`: free the workers' weight memory; refused while the engine has
        `unfinished` requests."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard them), got {level!r}")
        self._check_no_staged_push()
        if unfinished:
            raise RuntimeError(
                f"cannot sleep with {unfinished} unfinished requests; step() them to completion or abort() them first"
            )
        self._sent.clear()  # woken weights may be reloaded: the next delta push sends everything
        try:
            self.collective_rpc(Worker.sleep, args=(level,))
        except TimeoutError as error:
            raise self._reread_after("sleep", error) from error
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        """Restore the weights after `sleep`; does nothing when awake."""
        if self.sleep_level == 0:
            return
        deepest = self.sleep_level
        try:
            self.collective_rpc(Worker.wake_up)
        except TimeoutError as error:
            timeout = self._reread_after("wake_up", error)
            if self.sleep_level == 0:  # the late call woke them
                self._woke(deepest)
            raise timeout from error
        self._woke(deepest)

    def _woke(self, deepest: int) -> None:
        self.encoder_generation += 1
        if deepest == 2:
            self.versions.move_to(0)
        self.sleep_level = 0

    # After a timeout.

    def _reread_after(self, method: str, error: TimeoutError) -> TimeoutError:
        """A state-changing call timed out, and may still finish in a worker. Instead of guessing,
        read what the workers hold (a worker runs this read after the late call), make the engine's
        record match, and return the timeout to raise. Ranks left holding different adapters drop
        them; ranks at different sleep levels, or no answer, raise EngineDeadError."""
        # The read waits behind the late call; give it as long as a step may take.
        wait = max(self.config.rpc_timeout_s, self.config.step_timeout_s)
        try:
            states = self.collective_rpc(Worker.hot_swap_state, timeout=wait)
        except (TimeoutError, WorkerError) as reread_error:
            raise self._dead_after(method, f"their state could not be read back ({reread_error})") from error
        names = [set(state["loras"]) for state in states]
        split = sorted(set.union(*names) - set.intersection(*names))
        if split:
            for name in split:
                self.collective_rpc(Worker.discard_lora, args=(name,))
        levels = {state["sleep_level"] for state in states}
        if len(levels) > 1:
            raise self._dead_after(method, f"ranks are at different sleep levels {sorted(levels)}") from error
        self._loras = {name: bound for name, bound in states[0]["loras"].items() if name not in split}
        self.sleep_level = levels.pop()
        return TimeoutError(
            f"{error}; it may have finished in the workers since, so the engine read their state back: "
            f"LoRAs {self.list_loras()}"
            + (f" (dropped {split}: not on every rank)" if split else "")
            + f", sleep level {self.sleep_level}"
        )

    def _dead_after(self, method: str, why: str) -> EngineDeadError:
        return EngineDeadError(f"{method!r} timed out and {why}; create a new engine")


def _stages_the_live_lora(worker, name: str) -> bool:
    """On a worker: whether the adapter staged under `name` is its live one exactly."""
    return worker.loras.staged_is_live(name)


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an integer >= 1 (bytes per bucket), got {bucket_bytes!r}")


def _broadcast_entries(names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> list:
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"got {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; they must pair up")
    return [
        BroadcastEntry(name, TensorSpec(tuple(shape), dtype))
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True)
    ]
