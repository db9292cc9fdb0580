"""A worker: one model replica holding the live state of the requests assigned to its rank.

Its public methods are the worker functions `collective_rpc` can call by name; a
`worker_extension_cls` adds more (see `build_worker_class`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rollout.config import EngineConfig
from rollout.imports import import_by_path
from rollout.lora.manager import LoraManager, read_lora_folder
from rollout.messages import RunnerOutput, WorkerInput
from rollout.model_spec import ModelSpec
from rollout.parallel.cfg import CfgParallelPasses
from rollout.parallel.group_failures import FailureAgreement, GroupOutOfStep
from rollout.parallel.sequence import (
    GroupMember,
    enable_sequence_parallel,
    group_mesh,
    join_group,
    sequence_boundaries,
)
from rollout.pipelines.compiled_blocks import compile_blocks
from rollout.pipelines.loading import load_adapter
from rollout.weights.broadcast_group import BroadcastEntry, connect, receive_bucket
from rollout.weights.regular_files import check_regular
from rollout.weights.staging import BucketLayout, StagingHandle, StagingPool
from rollout.weights.state import StagedUpdates, TensorSpec, base_state, checksum, specs_of
from rollout.worker.marks import READ_ONLY, STEP, engine_route, functions_marked, read_only, step, worker_functions
from rollout.worker.model_runner import BatchLost, ModelRunner, RequestState, describe
from rollout.worker.progress import Progress
from rollout.worker.sent_conditions import SentConditions
from rollout.worker.sleep import Sleeper

logger = logging.getLogger(__name__)


class Worker:
    """`group`: this rank's place in its replica group when a replica spans several ranks
    (sequence parallel, CFG parallel); every rank of the group runs the same steps, and only the
    group's first rank hands back their outputs."""

    def __init__(self, config: EngineConfig, rank: int, group: GroupMember | None = None):
        self.config = config
        self.rank = rank
        self.group = group
        self.adapter = load_adapter(config.model, config.device, config.torch_dtype, config.attention_backend)
        # Advanced by every model block as it starts: what tells the engine a long step is still
        # computing (`EngineConfig.step_timeout_s` bounds a step's time without progress).
        self.progress = Progress()
        self.progress.watch(self.adapter.components.values())
        self.failure_agreement = None  # a group's ranks agree on failed steps (rollout.parallel.group_failures)
        boundaries = {}  # denoiser -> its modules where sequence parallel splits or gathers the tokens
        if group is not None:
            self.failure_agreement = FailureAgreement(join_group(group, config.device), group.local_rank, group.size)
            mesh = group_mesh(config.cfg_parallel, config.sequence_parallel, config.device)
            if config.sequence_parallel > 1:
                enable_sequence_parallel(self.adapter.denoisers, mesh, type(self.adapter.pipeline).__name__)
                boundaries = {name: sequence_boundaries(module) for name, module in self.adapter.denoisers.items()}
            if config.cfg_parallel > 1:
                self.adapter.guidance_passes = CfgParallelPasses(mesh)
        if config.compile == "blocks":
            # After sequence parallel has put diffusers' hooks on the model, so the compiled forward
            # runs what they made of it; the trainer's copy compiles the same (`load_adapter(compile=)`).
            compile_blocks(self.adapter.denoisers)
        self.loras = LoraManager(
            self.adapter.denoisers,
            merge=config.merges_lora,
            sequence_boundaries=boundaries,
            default_targets=self.adapter.default_lora_targets,
        )
        self.runner = ModelRunner(self.adapter, self.loras, config.compile)
        self.requests: dict[str, RequestState] = {}
        self.sent_conditions = SentConditions()  # the text embeddings the engine holds
        self.updates = StagedUpdates(self.adapter.components)
        self.staging = StagingPool()  # the buffers pushed buckets are written into (rollout.weights.staging)
        self.sleeper = Sleeper(self.adapter.components, config.model)
        self.broadcast_group = None  # joined by init_weight_update_group

    @step
    def execute(self, work: WorkerInput) -> RunnerOutput:
        """Run one engine step: drop aborted requests, start new ones, denoise, return finished.

        A request that fails fails alone: its state is dropped and it is reported in
        `RunnerOutput.failed`, while the rest of the step goes on (see `_step_isolating`)."""
        start = time.perf_counter()
        for request_id in work.free_ids:
            self.requests.pop(request_id, None)
        states, failed = self.runner.prepare(work.new_requests, self.requests.values(), work.encoder_generation)
        for state in states:
            self.requests[state.data.request_id] = state
        for fork in work.forks:  # tree rollouts: a path splits before the step it branches at
            if fork.parent_id in failed:  # it failed to start: so do its children, which the engine tracks now
                why = failed.pop(fork.parent_id)
                failed |= dict.fromkeys((child_id for child_id, _ in fork.children), why)
                continue
            for child in self.runner.fork(self.requests.pop(fork.parent_id), fork):
                self.requests[child.data.request_id] = child
        batch = [self.requests[request_id] for request_id in work.step_ids if request_id not in failed]
        failed |= self._step_isolating(batch)
        done = [s for s in batch if s.done and s.data.request_id not in failed]
        for state in done:
            del self.requests[state.data.request_id]
        if self.group is not None and not self.group.replies:
            # The group's first rank decodes and hands back what this step finished; this rank
            # only keeps its requests' state in step with it.
            for request_id in failed:
                self.requests.pop(request_id, None)
            self.adapter.forwards.take()
            return RunnerOutput(failed=failed, compute_s=time.perf_counter() - start)
        finished, decode_failed = self.runner.finish(done, self.sent_conditions)
        failed |= decode_failed
        for request_id in failed:
            self.requests.pop(request_id, None)
        embeds, released = self.sent_conditions.reply(state.condition for state in self.requests.values())
        rows, transformer_s = self.adapter.forwards.take()
        return RunnerOutput(
            finished=finished,
            failed=failed,
            embeds=embeds,
            released_embeds=released,
            compute_s=time.perf_counter() - start,
            transformer_rows=rows,
            transformer_s=transformer_s,
        )

    def _step_isolating(self, batch: list[RequestState]) -> dict[str, str]:
        """Step `batch`; if its forward fails, step each of its requests alone, so only those that
        fail alone fail (request id -> error). The failure is logged with its traceback here. In a
        replica group, a rank goes on from a failure only where every rank of its group failed the
        same way (else `GroupOutOfStep`: see `rollout.parallel.group_failures`)."""
        if not batch:
            return {}
        try:
            self.runner.step(batch)
        except BatchLost as error:
            self._check_group_failed_too(f"lost {len(batch)}", error)
            logger.error("%s; failing its requests", error, exc_info=True)
            return dict.fromkeys((s.data.request_id for s in batch), describe(error.__cause__))
        except Exception as error:
            self._check_group_failed_too(f"forward {len(batch)}", error)
            if len(batch) == 1:
                logger.warning("request %s failed in its step", batch[0].data.request_id, exc_info=True)
                return {batch[0].data.request_id: describe(error)}
            logger.warning("a step of %d requests failed (%s); stepping them one by one", len(batch), describe(error))
            return {request_id: why for state in batch for request_id, why in self._step_isolating([state]).items()}
        return {}

    def _check_group_failed_too(self, what: str, error: Exception) -> None:
        """In a replica group: raise `GroupOutOfStep` unless every rank failed this step with `what`."""
        if self.failure_agreement is None or self.failure_agreement.all_failed(what):
            return
        raise GroupOutOfStep(
            f"rank {self.group.local_rank} of replica group {self.group.group} failed a step ({what} requests) "
            f"that its group's other ranks did not fail within {self.failure_agreement.grace_s}s: {describe(error)}"
        ) from error

    @read_only
    def model_spec(self) -> ModelSpec:
        return self.adapter.spec

    @read_only
    def check_health(self) -> bool:
        """True while the worker can run; raises otherwise (e.g. the device is gone)."""
        if self.config.device.startswith("cuda"):
            torch.cuda.synchronize(self.adapter.device)
        return True

    @read_only
    def get_rank(self) -> int:
        return self.rank

    @read_only
    def request_ids(self) -> list[str]:
        """Ids of the requests whose state this worker holds."""
        return sorted(self.requests)

    # Weight updates: the engine validates, then stages on every rank, then applies everywhere, then
    # commits (or rolls back every rank if one failed to apply). Whatever reads or swaps base weights
    # (these, the checksum, sleep) first restores them where a LoRA adapter is merged into them, so
    # it sees and changes the base; the next forward merges again, with the new base.

    @read_only
    def weight_specs(self, component: str) -> dict[str, TensorSpec]:
        return specs_of(self.updates.module(component))

    @engine_route("update_weights")
    def stage_weights(self, component: str, named_tensors: dict[str, torch.Tensor]) -> int:
        return self.updates.stage(component, named_tensors)

    @engine_route("update_weights")
    def reserve_staging(self, sizes: list[int], shared: bool, in_process: bool) -> list[StagingHandle]:
        """A staging buffer for each bucket of a push (`sizes`: their bytes), in a shared-memory
        file with `shared` (for an engine in another process), handed back as the buffer itself
        `in_process`. The engine writes the buckets into them; `stage_weights_from_staging` stages each."""
        return self.staging.reserve(sizes, shared, in_process, self.adapter.device)

    @engine_route("update_weights")
    def stage_weights_from_staging(self, component: str, layout: BucketLayout) -> int:
        """Stage the next reserved buffer's bucket (written by the engine, checked there): views of
        it on a CPU model, copies on another device."""
        return self.updates.stage(component, layout.views(self.staging.take(layout.nbytes)))

    @engine_route("update_weights")
    def stage_weights_flat(self, component: str, layout: BucketLayout, flat: torch.Tensor) -> int:
        """Stage a bucket that came through the transport as one flat buffer (this worker's own copy)."""
        self.staging.cancel()  # the engine could not reach the buffers it reserved
        return self.updates.stage(component, layout.views(flat))

    @engine_route("update_weights_from_worker")
    def stage_weights_from_function(
        self, component: str, method: str, args: Sequence, kwargs: dict, check_finite: bool
    ) -> int:
        """Stage what the `@stages_weights` worker function `method` (the engine checked its mark:
        `rollout.worker.marks.staging_function`) returns or yields: a name -> tensor mapping or
        (name, tensor) pairs of `component`, each checked as `update_weights` checks a tensor;
        returns how many are staged. A refusal (ValueError) stages nothing."""
        produced = getattr(type(self), method)(self, *args, **kwargs)
        pairs = produced.items() if isinstance(produced, Mapping) else produced
        return self.updates.stage_pairs(component, pairs, check_finite)

    @engine_route("update_weights_from_disk")
    def stage_weights_from_files(self, component: str, files: list[str], check_finite: bool) -> int:
        from safetensors.torch import load_file

        parts = (load_file(check_regular(file, "weights file")) for file in files)
        return self.updates.stage_checked(component, parts, check_finite)

    @engine_route("init_weight_update_group")
    def init_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Join the trainer's broadcast group as rank `rank_offset + self.rank`; returns that rank."""
        group_rank = rank_offset + self.rank
        self.broadcast_group = connect(master_address, master_port, group_rank, world_size, backend, timeout_s)
        return group_rank

    @engine_route("update_weights_from_distributed")
    def stage_weights_from_broadcast(
        self, component: str, buckets: list[list[BroadcastEntry]], check_finite: bool
    ) -> int:
        if self.broadcast_group is None:
            raise RuntimeError("no weight update group: call init_weight_update_group first")
        device = self.adapter.device
        received = (receive_bucket(self.broadcast_group, bucket, device) for bucket in buckets)
        return self.updates.stage_checked(component, received, check_finite)

    @read_only
    def staged_weights_are_live(self, component: str) -> bool:
        """Whether the tensors staged for `component` are the weights it holds (a repeated push)."""
        self.loras.restore()  # compare with the base, not a merged adapter
        return self.updates.staged_is_live(component)

    @engine_route("update_weights")
    def apply_staged_weights(self, component: str) -> int:
        self.loras.restore()
        return self.updates.apply(component)

    @engine_route("update_weights")
    def commit_weights(self, component: str) -> None:
        self.loras.restore()
        self.updates.commit(component)
        self.staging.trim()

    @engine_route("update_weights")
    def rollback_weights(self, component: str) -> None:
        self.loras.restore()
        self.updates.rollback(component)
        self.staging.cancel()

    @read_only
    def weights_checksum(self, component: str) -> str:
        self.loras.restore()
        return checksum(base_state(self.updates.module(component)))

    @engine_route("load_lora")
    def stage_lora(
        self, name: str, source: str | dict[str, torch.Tensor], config: dict | None, check_finite: bool = True
    ) -> int:
        """Check adapter `name` (from a folder path or tensors) and build it beside the live one;
        returns the number of modules it binds. `check_finite`: refuse NaN or infinity. A refusal
        (ValueError) or a failed build leaves the worker as it was."""
        tensors, folder_config = read_lora_folder(source) if isinstance(source, str) else (source, None)
        return self.loras.stage(name, tensors, config if config is not None else folder_config, check_finite)

    @engine_route("load_lora")
    def commit_lora(self, name: str) -> None:
        self.loras.commit(name)

    @engine_route("load_lora")
    def rollback_lora(self, name: str) -> None:
        self.loras.rollback(name)

    @engine_route("unload_lora")
    def unload_lora(self, name: str) -> None:
        self.loras.unload(name)

    @engine_route("unload_lora")
    def discard_lora(self, name: str) -> None:
        """Drop `name`, staged or loaded, if this worker has it (cleanup after a failure on some rank)."""
        self.loras.rollback(name)
        if name in self.loras.configs:
            self.loras.unload(name)

    @engine_route("sleep")
    def sleep(self, level: int) -> None:
        shared = self.updates.shared()
        if shared:
            raise ValueError(
                f"sleep refused: a trainer's policy in this process shares the base weights of {', '.join(shared)} "
                "(LoraPolicy.sharing_base), so sleeping would free none of them; keep the engine awake while it "
                "shares them, or give the trainer its own copy (LoraPolicy(model, ...)) to sleep the engine"
            )
        self.loras.restore()
        self.staging.release()  # the spare buffers of the last push: memory sleep is asked to free
        self.sleeper.sleep(level)

    @read_only
    def hot_swap_state(self) -> dict:
        """What the engine tracks of this worker: adapters (name -> modules bound) and sleep level;
        and the (adapter, scale) merged into the base weights for the forward, or None, and how
        many merges this worker has made (one per change of the forward's adapter or scale, and one
        after each function that restored the base weights)."""
        return {
            "loras": {name: self.loras.bound_modules(name) for name in self.loras.configs},
            "sleep_level": self.sleeper.level,
            "merged_lora": self.loras.merged,
            "merges": self.loras.merges,
        }

    @engine_route("wake_up")
    def wake_up(self) -> None:
        self.sleeper.wake_up()


def call_function(worker: Worker, fn: Callable, args: Sequence, kwargs: dict) -> Any:
    """`fn(worker, *args, **kwargs)` as a worker runs what an executor sends it: an engine step
    (`Worker.execute`) or a `collective_rpc` function, on every executor. Any function but a step
    and the worker's own read-only ones gets the base weights back first where a LoRA adapter is
    merged into them for the forward (`rollout.lora.merge`): a user's function that reads or writes
    a weight sees the base, and what it writes is not lost when the merge is undone. The next
    forward merges again. A step never restores: an adapter merges once per change, not per step."""
    name = getattr(fn, "__name__", None)
    if not (name in _KEEP_THE_MERGE and fn is getattr(type(worker), name, None)):
        worker.loras.restore()
    return fn(worker, *args, **kwargs)


# Instance attributes a worker sets in __init__; an extension method of the same name would be hidden.
_WORKER_ATTRIBUTES = {
    "config",
    "rank",
    "adapter",
    "runner",
    "requests",
    "sent_conditions",
    "updates",
    "staging",
    "sleeper",
    "loras",
    "broadcast_group",
    "group",
    "failure_agreement",
    "progress",
}


# The worker's own read-only functions. The others change what the engine keeps (the requests, the
# weights and their version, the adapters, the sleep level) and have engine calls of their own.
READ_ONLY_METHODS = functions_marked(Worker, READ_ONLY)
# What runs with a merged LoRA adapter left in place: an engine step, whose forward merges only when
# its adapter or scale changes (`LoraManager.activate`), and the read-only functions.
_KEEP_THE_MERGE = READ_ONLY_METHODS | functions_marked(Worker, STEP)


def build_worker_class(extension: str | type | None) -> type[Worker]:
    """`Worker`, or a subclass that mixes in `extension`'s methods.

    An extension may not redefine a worker's own method: that would silently change the engine.
    """
    if extension is None:
        return Worker
    if isinstance(extension, str):
        extension = import_by_path(extension, "worker_extension_cls")
    if not isinstance(extension, type):
        raise TypeError(f"worker_extension_cls must be a class or a dotted path to one, got {extension!r}")
    clashes = sorted(worker_functions(extension) & (worker_functions(Worker) | _WORKER_ATTRIBUTES))
    if clashes:
        raise ValueError(
            f"worker_extension_cls {extension.__qualname__} redefines worker methods {clashes}; "
            "rename them in the extension"
        )
    return type(f"Worker+{extension.__name__}", (Worker, extension), {})
