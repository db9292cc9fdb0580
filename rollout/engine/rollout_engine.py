"""The rollout engine: what a trainer drives.

`generate` is the one-call path; `add_request` / `step` / `abort` let a caller drive the engine
itself (to stream outputs or interleave its own work). Worker functions are reached through
`collective_rpc`.

Past 400 lines: the hot-swap API is written out here (signatures, defaults and docstrings an IDE
shows), each method a few lines that sequence `HotSwap` (the engine's open and dead state, and the
drains of its running requests, are decided here), so that a reader lands on the front's own code.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from rollout.api import DEFAULT_BUCKET_BYTES, DEFAULT_COMPONENT
from rollout.config import EngineConfig
from rollout.engine.config_check import check_engine_config
from rollout.engine.hot_swap import HotSwap, WeightUpdate
from rollout.engine.received_conditions import ReceivedConditions
from rollout.engine.request import Request, RequestStatus, step_stream
from rollout.engine.scheduler import Scheduler
from rollout.engine.shared_conditions import SharedConditions
from rollout.engine.shared_parts import SharedTreeParts
from rollout.engine.step_report import StepReport
from rollout.engine.work_budget import WorkBudget
from rollout.errors import EngineDeadError, RequestFailedError, RequestIdTaken, interrupted_reason
from rollout.input_images import InputImages, images_per_prompt
from rollout.messages import FinishedRequest
from rollout.node_id import NodeId
from rollout.outputs import RequestTimings, RolloutOutput
from rollout.sampling_params import SamplingParams
from rollout.seeding import derive_seed, fresh_base_seed
from rollout.worker.marks import name_on_the_wire
from rollout.worker.work_profile import WorkProfile, measure_work
from rollout.worker.worker import Worker

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig

    from rollout.engine.weight_sync import StagedPush

logger = logging.getLogger(__name__)

# The ids `add_request` makes (groups "req0", "req1", ..., their samples "req0-0", ...): a caller
# may not take one, else a request of another caller (another client of a server) that gets it next
# would be refused as a clash.
_AUTOMATIC_ID = re.compile(r"req[0-9]+(-[0-9]+)?")


class RolloutEngine:
    """Samples images with their denoising trajectories and log-probs.

    >>> with RolloutEngine(EngineConfig(model="path/to/pipeline")) as engine:
    ...     outputs = engine.generate(["a red square"], SamplingParams(num_samples=4, seed=0))
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.executor = check_engine_config(config)(config)  # before any worker starts
        try:
            self.model_spec = self.executor.collective_rpc(Worker.model_spec)[0]
            # What a request's units of work would take here, measured once on every rank (admission by work).
            profiles = self.executor.collective_rpc(measure_work, timeout=config.startup_timeout_s)
        except BaseException:
            self.executor.shutdown()  # a start that fails leaves no worker behind
            raise
        self.work_budget = WorkBudget(
            WorkProfile.slowest(profiles), self.model_spec, config.step_timeout_s, config.max_batch_size
        )
        # A trainer passes the same params for every prompt and group: resolving them once each
        # halves what add_request costs (SamplingParams is frozen and hashable).
        self._resolve = functools.lru_cache(maxsize=256)(self.model_spec.resolve)
        # Batches go to replicas: a replica of several ranks (sequence parallel) runs each as one.
        self.scheduler = Scheduler(num_ranks=config.num_replicas, max_batch_size=config.max_batch_size)
        self._request_counter = itertools.count()
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._stashed_outputs: list[RolloutOutput] = []  # finished while an update waited for them
        self._received_conditions = ReceivedConditions(config.num_replicas)
        self._conditions = SharedConditions(self.model_spec)
        self._tree_parts = SharedTreeParts()
        self._tree_ids = itertools.count()
        self._step_observers: list[Callable[[StepReport], None]] = []
        self.hot_swap = HotSwap(self.executor, self.model_spec, self.collective_rpc)

    # Generation.

    def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        images: Sequence | None = None,
        use_tqdm: bool = False,
    ) -> list[RolloutOutput]:
        """Generate `num_samples` samples per prompt; outputs ordered by prompt, then sample.

        `params` is one `SamplingParams` for all prompts or one per prompt (they may differ in
        anything: all share batches when their image sizes and adapters match). `images`: for an
        edit family, one entry per prompt, each a list of uint8 [3, H, W] tensors or PIL images (its
        pipeline's `image=`), or None for a text-only prompt. Outputs of requests added with
        `add_request` that finished earlier (during a waiting weight update) stay for the next `step()`.
        """
        self._check_open()
        self._check_awake()
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                f"generate() drives the engine itself, but {len(self.scheduler)} requests added with "
                "add_request() are unfinished; step() them to completion or abort() them first"
            )
        request_ids = self.add_requests(prompts, params, images=images)
        try:
            outputs = self._run_to_the_end(request_ids, use_tqdm)
        except BaseException:
            # A generate that fails leaves none of its requests behind (they are all its own).
            if self._dead is None and self.scheduler.has_unfinished():
                self.abort(self.unfinished_request_ids())
            raise
        return [outputs[request_id] for request_id in request_ids]

    def _run_to_the_end(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RolloutOutput]:
        total_steps = sum(r.num_leaves * r.params.num_inference_steps for r in self.scheduler.requests.values())
        outputs: dict[str, RolloutOutput] = {}
        # Progress in denoising steps of the leaves, not samples: a group of samples finishes all at once.
        with (
            self._interrupts_are_fatal(),
            tqdm(total=total_steps, desc="rollout", unit="step", disable=not use_tqdm) as bar,
        ):
            while self.scheduler.has_unfinished():
                for output in self._step_once():  # not step(): parked outputs are someone else's
                    if output.status == "failed":
                        raise RequestFailedError(output.request_id, output.error)
                    outputs[output.request_id] = output
                done = sum(r.num_leaves * r.steps_done for r in self.scheduler.requests.values())
                done += sum(o.trajectory.num_steps for o in outputs.values() if o.trajectory is not None)
                bar.update(done - bar.n)
                bar.set_postfix(samples=f"{len(outputs)}/{len(request_ids)}")
        return outputs

    def add_requests(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        images: Sequence | None = None,
    ) -> list[str]:
        """Queue what `generate` would run, without running it; returns the sample ids in the order
        `generate` returns outputs. Every request is checked before any is queued, and prompts
        without a seed share one fresh base seed, as in `generate`."""
        self._check_open()
        self._check_awake()
        if isinstance(prompts, str):
            prompts = [prompts]
        params_list = self._params_per_prompt(prompts, params)
        images_list = images_per_prompt(images, len(prompts))
        self._check_input_images([() if one is None else one.sizes for one in images_list])
        for prompt, p, one in zip(prompts, params_list, images_list, strict=True):
            self._check_request(prompt, p, () if one is None else one.sizes)  # all of them before any is queued
        base_seed = fresh_base_seed()
        request_ids = []
        for prompt_index, (prompt, p, one) in enumerate(zip(prompts, params_list, images_list, strict=True)):
            request_ids += self.add_request(prompt, p, images=one, prompt_index=prompt_index, base_seed=base_seed)
        return request_ids

    def check_requests(
        self,
        prompts: Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None,
        image_sizes: Sequence[Sequence[tuple[int, int]]],
    ) -> None:
        """Raise ValueError for what `add_requests(prompts, params, images=)` would refuse, from the
        input images' sizes alone (`image_sizes`: per prompt, the (height, width) of each image as
        sent). A server asks before it decodes any image file a client sent: a few KB of PNG can
        hold gigabytes of pixels. Any thread may ask; the adapters named are checked as loaded
        now (and again when the requests are added: one may be unloaded meanwhile)."""
        params_list = self._params_per_prompt(prompts, params)
        self._check_input_images(image_sizes)
        problems = [
            problem
            for prompt, one, sizes in zip(prompts, params_list, image_sizes, strict=True)
            for problem in self._request_problems(prompt, one, tuple(sizes))[1] + self._lora_problems(one)
        ]
        if problems:
            raise ValueError("invalid request: " + "; ".join(dict.fromkeys(problems)))

    def _check_input_images(self, sizes: Sequence[Sequence[tuple[int, int]]]) -> None:
        """Raise ValueError if one request's input images of these sizes (per prompt) are more than
        the model takes per prompt (none, for a text-to-image family), or past
        `RequestLimits.max_input_images` and `max_input_pixels`."""
        most = self.model_spec.max_input_images
        too_many = [tuple(one) for one in sizes if len(one) > most]
        # Its first problem is the count's ("takes no input images", "takes at most N").
        problems = self._image_problems(too_many[0])[:1] if too_many else []
        problems += self.config.request_limits.input_image_problems(sizes)
        if problems:
            raise ValueError("invalid request: " + "; ".join(problems))

    def add_request(
        self,
        prompt: str,
        params: SamplingParams,
        *,
        images: Sequence | None = None,
        prompt_index: int = 0,
        request_id: str | None = None,
        base_seed: int | None = None,
    ) -> list[str]:
        """Queue `params.num_samples` requests for one prompt; returns the ids of their outputs:
        "{request_id}-{sample_index}", and with branching one per leaf,
        "{request_id}-{sample_index}.{child}.{child}...", in branch-path order. Seeds derive from
        `params.seed` (or `base_seed` when the params give none, else a fresh one), `prompt_index`,
        the sample index and the branch path.

        `images`: the prompt's input images for an edit family (a list of uint8 [3, H, W] tensors or
        PIL images), shared by its samples.

        A `request_id` that an unfinished request's group or sample id already has, or whose
        sample ids would be one's group id, is refused: `abort` takes both kinds of id. It may not
        hold "." (which separates the branches of a tree rollout), nor have the form of the ids the
        engine makes ("req<n>", "req<n>-<k>"), which are another caller's."""
        self._check_open()
        self._check_awake()
        if request_id is not None and "." in request_id:
            raise ValueError(f"request_id {request_id!r} holds '.', which names tree branches; pass one without")
        if request_id is not None and _AUTOMATIC_ID.fullmatch(request_id):
            raise ValueError(
                f"request_id {request_id!r} has the form of an id the engine makes ('req<n>' for a request "
                "without a request_id, 'req<n>-<k>' for its samples), which it may give another caller's "
                "request next; pass another"
            )
        if images is not None and not isinstance(images, InputImages):
            images = InputImages.of(images)
        if images is not None:
            self._check_input_images([images.sizes])
        params = self._check_request(prompt, params, () if images is None else images.sizes)
        if images is not None:  # the encoding it asks for
            images = images.encoded_with(**self.model_spec.image_encoding(params))
        group_id = request_id if request_id is not None else f"req{next(self._request_counter)}"
        roots = [NodeId(group_id, k) for k in range(params.num_samples)]
        self._check_ids_free(group_id, [str(root) for root in roots])
        if params.seed is not None:
            base_seed = params.seed
        elif base_seed is None:
            base_seed = fresh_base_seed()
        spec = self.model_spec
        # A first frame is encoded at the request's own size, which its batch key holds already.
        unsized = images is None or spec.first_frame
        encoded_sizes = () if unsized else spec.encoded_image_sizes(images.sizes, spec.auto_resizes(params))
        encoded = () if images is None else spec.encoded_image_pixels(images.sizes, spec.auto_resizes(params))
        max_batch = self.work_budget.samples_per_batch(params, encoded)
        output_ids = []
        for k, root in enumerate(roots):
            init_index = 0 if params.same_noise_in_group else k
            request = Request(
                node_id=root,
                prompt=prompt,
                prompt_index=prompt_index,
                params=params,
                seed=derive_seed(base_seed, prompt_index, k, step_stream(())),
                init_noise_seed=derive_seed(base_seed, prompt_index, init_index, "init"),
                base_seed=base_seed,
                tree_id=next(self._tree_ids),
                images=images,
                encoded_image_sizes=encoded_sizes,
                max_batch=max_batch,
            )
            self.scheduler.add(request)
            output_ids += [str(leaf) for leaf in request.leaves()]
        return output_ids

    def _check_ids_free(self, group_id: str, sample_ids: list[str]) -> None:
        table = self.scheduler
        clashes = [group_id] if table.is_live_group(group_id) or table.is_live_id(group_id) else []
        clashes = sorted(clashes + [sample_id for sample_id in sample_ids if table.is_live_group(sample_id)])
        if clashes:
            raise RequestIdTaken(
                f"request_id {group_id!r} is refused: {clashes} already name unfinished requests or groups of this "
                "engine (abort() takes both sample and group ids). Every caller of an engine, every client of a "
                "server, shares its ids: pass another request_id, one with a prefix of your own (your run's "
                "name), or none to get one the engine makes"
            )

    def step(self, *, admit: bool = True) -> list[RolloutOutput]:
        """Run one engine step (one denoising step for one batch per worker); returns the
        outputs of requests that finished in it, and of those that finished outside `step`
        (while an update with mode="wait" ran them to the end). `admit=False` steps only the
        requests already running, leaving waiting ones queued (a pause that lets work finish)."""
        self._check_open()
        with self._interrupts_are_fatal():
            return self.take_finished() + self._step_once(admit)

    def take_finished(self) -> list[RolloutOutput]:
        """Outputs of requests that finished outside `step` (during an update with mode="wait")
        and were not returned yet; each is returned once, by this or by `step`."""
        outputs, self._stashed_outputs = self._stashed_outputs, []
        return outputs

    def unfinished_request_ids(self, *, running_only: bool = False) -> list[str]:
        """Sample ids of the unfinished requests; `running_only`: of those admitted to a worker."""
        if running_only:
            return list(self.scheduler.running)
        return list(self.scheduler.requests)

    def _step_once(self, admit: bool = True) -> list[RolloutOutput]:
        start = time.perf_counter()
        scheduled = self.scheduler.schedule(admit, self.hot_swap.encoder_generation)
        outputs: list[RolloutOutput] = []
        if scheduled.is_empty:
            return outputs
        # A request split over ranks (sequence parallel) is in several ranks' inputs: one step each.
        stepped = {request_id for work in scheduled.worker_inputs.values() for request_id in work.step_ids}
        for request_id in stepped:
            self.scheduler.requests[request_id].note_step_version(self.weight_version)
        execute_start = time.perf_counter()
        runner_outputs = self._on_executor(self.executor.execute, scheduled)
        execute_s = time.perf_counter() - execute_start
        for rank, runner_output in enumerate(runner_outputs):
            self._received_conditions.attach(rank, runner_output)
            for request_id, error in runner_output.failed.items():
                request = self.scheduler.finish(request_id)
                logger.warning("request %s failed alone in its worker: %s", request_id, error)
                outputs += [self._make_output(request, None, leaf, error=error) for leaf in request.leaves()]
            for finished in runner_output.finished:
                request = self.scheduler.finish(finished.request_id)
                trajectory = finished.trajectory
                if trajectory is not None:
                    trajectory.condition = self._conditions.share(request, trajectory.condition)
                    self._tree_parts.share(request.tree_id, trajectory, finished.part_nodes)
                outputs.append(self._make_output(request, finished))
        if self._step_observers:
            report = StepReport(
                kind="step",
                name="step",
                wall_s=time.perf_counter() - start,
                execute_s=execute_s,
                compute_s=tuple(o.compute_s for o in runner_outputs),
                transformer_rows=tuple(o.transformer_rows for o in runner_outputs),
                transformer_s=tuple(o.transformer_s for o in runner_outputs),
                finished=len(outputs),
            )
            self._notify(report)
        return outputs

    def add_step_observer(self, observer: Callable[[StepReport], None]) -> Callable[[], None]:
        """Call `observer(StepReport)` after every engine step that ran work and every worker
        function, in the engine's thread; returns a function that removes it. An observer that
        raises is logged and removed, and the engine goes on (its outputs are not lost)."""
        self._step_observers.append(observer)

        def remove() -> None:
            if observer in self._step_observers:  # it may have removed itself by raising
                self._step_observers.remove(observer)

        return remove

    def _notify(self, report: StepReport) -> None:
        for observer in list(self._step_observers):
            try:
                observer(report)
            except Exception:
                logger.exception("step observer %r raised; it is removed", observer)
                self._step_observers.remove(observer)

    def abort(self, request_ids: str | Iterable[str]) -> list[RolloutOutput]:
        """Abort requests by sample id, by the group id `add_request` was given (all its samples),
        or, in a tree rollout, by the id of any branch or leaf (that subtree; its siblings run on).
        Their worker state is freed before this returns. Unknown ids are ignored (the request may
        have just finished). Returns one output with status "aborted" per leaf aborted."""
        self._check_open()
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = []
        for target in request_ids:
            whole = self.scheduler.matching(target)  # its id, its group's, or one it branched from
            for request in whole:
                aborted += self._abort_request(request, request.leaves())
            node = None if whole else _node_named(target)
            request = None if node is None else self.scheduler.future_parent(node)
            if request is not None:
                # A branch it has not split into yet: its leaves end now, the others run on.
                pruned = [leaf for leaf in request.leaves() if leaf == node or node.is_ancestor_of(leaf)]
                request.pruned.add(node)
                if request.leaves():
                    aborted += [self._make_output(request, None, leaf) for leaf in pruned]
                else:
                    aborted += self._abort_request(request, pruned)
        self._flush_frees()
        return aborted

    def _abort_request(self, request: Request, leaves: list[NodeId]) -> list[RolloutOutput]:
        """Drop a live request; one aborted output per leaf in `leaves`."""
        self.scheduler.abort(request.request_id)
        return [self._make_output(request, None, leaf) for leaf in leaves]

    def has_unfinished_requests(self) -> bool:
        """Whether any request added is not finished yet (its output not returned)."""
        return self.scheduler.has_unfinished()

    # Weights, adapters and memory: the hot swap's.

    def update_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        check_finite: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        delta: bool = False,
    ) -> int:
        """Replace weights of `component` on every worker, all at once; returns the new weight version.

        `named_tensors`: a name -> tensor mapping or an iterator of (name, tensor) pairs (streamed in
        buckets of about `bucket_bytes`); names and shapes must be the component's own, dtypes its
        own or widened exactly (`rollout.weights.state.DTYPE_RULE`: bfloat16 into a float32 model is
        converted, float32 into a bfloat16 model refused), and with `check_finite` every value must
        be finite (one summing pass over the bytes; `benchmarks/weight_sync` measures it; False
        skips it). A bad update is refused whole (ValueError listing every offending tensor) and
        nothing changes. An update may name some of the component's weights: those change, the
        rest keep their values (compare `weights_checksum` to check a full push). `mode="wait"`: running
        requests finish on the old weights first (their outputs come from the next `step()`);
        `mode="pause"`: the update applies now, between two steps, and running requests continue
        on the new weights (`RolloutOutput.weight_versions` lists both).
        The version becomes `version`, or the current one plus 1; a `version` below the current one
        is refused unless the engine held it before (`rollout.engine.weight_versions`). Workers keep copies
        of the tensors, so the caller may change them at once; tensors wrapped in `HandedOver` (a
        caller that never touches them again) are kept as they are where the workers run in this
        process. Each bucket is written once, into the workers' staging memory, which becomes
        their weights (`rollout.weights.staging`); the caller's tensors are only read during the call.
        `delta=True` sends only the tensors whose fingerprint changed since the version every worker
        holds (`rollout.weights.delta`; the first delta push, and any after another update or a
        sleep, sends everything); `hot_swap.last_push` says what was sent (`changed_fraction`).
        """
        self._check_open()
        update = self.hot_swap.weight_update(
            named_tensors,
            component=component,
            version=version,
            mode=mode,
            check_finite=check_finite,
            bucket_bytes=bucket_bytes,
            delta=delta,
        )
        return self._apply_update(update)

    def update_weights_from_disk(
        self,
        path: str | Path,
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        check_finite: bool = True,
    ) -> int:
        """`update_weights` from a .safetensors file or a diffusers component folder: every worker
        reads the files itself. Names, shapes and dtypes are checked from the file headers first,
        the values (`check_finite`) by the workers as they read them."""
        self._check_open()
        update = self.hot_swap.weight_update_from_disk(
            path, component=component, version=version, mode=mode, check_finite=check_finite
        )
        return self._apply_update(update)

    def update_weights_from_worker(
        self,
        method: str,
        args: Sequence = (),
        kwargs: dict | None = None,
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        check_finite: bool = True,
    ) -> int:
        """`update_weights` whose tensors every worker reads from a source of the user's own
        (shared memory, a file, a collective of its own): the `@stages_weights` function `method`
        of `worker_extension_cls` (`rollout.worker.marks`), called on every rank with `args` and
        `kwargs`, returns or yields (name, tensor) pairs of `component`. Each rank checks and stages
        them as `update_weights` checks its tensors; then every rank applies the update or none
        does: a function that raises or is refused on any rank, or ranks that stage different
        numbers of tensors, roll every rank back (ValueError for a refusal, the rank's
        `WorkerError` for a failure) and the weights and their version stay. `version` and `mode`
        as in `update_weights`."""
        self._check_open()
        update = self.hot_swap.weight_update_from_worker(
            method, args, kwargs, component=component, version=version, mode=mode, check_finite=check_finite
        )
        return self._apply_update(update)

    def open_weight_push(
        self,
        *,
        component: str = DEFAULT_COMPONENT,
        check_finite: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        version: int | None = None,
        delta: bool = False,
    ) -> StagedPush:
        """`update_weights` in parts, for a caller whose tensors arrive over time (the HTTP
        server's streamed push): `push.add(pairs)` stages them, a call of its own each, and the
        engine may step between the calls (staged tensors are invisible to sampling);
        `finish_weight_push` applies the update, `abort_weight_push` drops it. While it is open,
        every other weight update and sleep is refused (RuntimeError): they would stage beside it.
        `version`: the one `finish_weight_push` will be given, refused now if it may not be taken
        (and checked again then), so that a push refused for it is refused before its tensors come."""
        self._check_open()
        return self.hot_swap.open_weight_push(
            component=component, check_finite=check_finite, bucket_bytes=bucket_bytes, version=version, delta=delta
        )

    def finish_weight_push(self, push: StagedPush, *, version: int | None = None, mode: str = "wait") -> int:
        """Apply an update opened with `open_weight_push` as `update_weights` applies its own;
        returns the new weight version. It has ended whether this returns or raises."""
        try:
            return self._apply_update(self.hot_swap.finishing_update(push, version=version, mode=mode))
        except BaseException as error:  # refused before the push's own finish: drop what it staged
            self.abort_weight_push(push, error)
            raise

    def abort_weight_push(self, push: StagedPush, cause: BaseException) -> None:
        """Drop what an update opened with `open_weight_push` staged (its body failed); a drop that
        fails on some rank leaves ranks that may disagree, and the engine dead."""
        with self._swap_failures_are_fatal():
            self.hot_swap.abort_weight_push(push, cause)

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> list[int]:
        """Join a trainer's broadcast group: worker r becomes group rank `rank_offset + r`; the
        trainer is rank 0 and hosts the store at master_address:master_port. Blocks until every
        rank has joined, so the trainer joins concurrently (see
        `trainers_adapters.weights.broadcast.WeightBroadcaster`). Returns the workers' group ranks."""
        self._check_open()
        return self.hot_swap.init_weight_update_group(
            master_address, master_port, rank_offset, world_size, backend, timeout_s
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[tuple[int, ...]],
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        check_finite: bool = True,
    ) -> int:
        """`update_weights` whose tensors the trainer broadcasts through the group (in this order, in
        buckets of `bucket_bytes`) while this call waits; names, dtypes and shapes are checked first,
        the values (`check_finite`) by the workers once received."""
        self._check_open()
        update = self.hot_swap.weight_update_from_distributed(
            names,
            dtypes,
            shapes,
            component=component,
            version=version,
            mode=mode,
            bucket_bytes=bucket_bytes,
            check_finite=check_finite,
        )
        return self._apply_update(update)

    def check_weight_update(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[tuple[int, ...]],
        component: str = DEFAULT_COMPONENT,
    ) -> None:
        """Raise ValueError if an update with these tensors would be refused (a trainer checks before
        it broadcasts, so receivers are never left waiting for a refused update)."""
        self._check_open()
        return self.hot_swap.check_weight_update(names, dtypes, shapes, component)

    def weights_checksum(self, component: str = DEFAULT_COMPONENT) -> str:
        """SHA-256 of every weight of `component`; raises if the ranks disagree."""
        return self.hot_swap.weights_checksum(component)

    def load_lora(
        self,
        name: str,
        source: str | Path | Mapping[str, torch.Tensor],
        config: LoraConfig | Mapping | None = None,
        *,
        version: int | None = None,
        check_finite: bool = True,
    ) -> int:
        """Load a LoRA adapter on every worker, or hot-swap the one of that name; returns the new
        weight version (the current one plus 1, or `version`), as `update_weights` does, so a
        trainer pushing its adapter after each step can check what the next rollouts will carry.

        `source`: a PEFT folder (adapter_config.json + adapter_model.safetensors), a diffusers LoRA
        folder (pytorch_lora_weights.safetensors), or a mapping of PEFT LoRA tensors with `config`
        (a `peft.LoraConfig` or its dict; without `target_modules` it targets the family's default
        modules). Requests pick it with `SamplingParams(lora=name)`. The engine keeps LoRA layers
        in float32: tensors of a dtype that widens to it exactly are taken, others refused.
        Running requests finish on the adapter they started with. An adapter whose keys do not fit
        the model, or (with `check_finite`) that holds NaN or infinity, is refused (ValueError) and
        the one loaded before stays.
        """
        self._check_open()
        with self._swap_failures_are_fatal():
            staged = self.hot_swap.stage_lora(name, source, config, version=version, check_finite=check_finite)
            if staged.repeat:  # every rank staged exactly its live adapter: dropped, nothing changes
                return staged.version
            try:
                self._finish_running_requests()  # on the adapter they started with
            except BaseException:
                self.hot_swap.drop_staged_lora(staged)
                raise
            return self.hot_swap.commit_lora(staged)

    def unload_lora(self, name: str) -> None:
        """Remove adapter `name` from every worker and free its memory."""
        self._check_open()
        users = [r.request_id for r in self.scheduler.requests.values() if r.params.lora == name]
        with self._swap_failures_are_fatal():
            self.hot_swap.unload_lora(name, users)

    def lora_modules(self, name: str) -> int:
        """How many modules adapter `name` binds."""
        return self.hot_swap.lora_modules(name)

    def list_loras(self) -> list[str]:
        """Names of the loaded LoRA adapters."""
        return self.hot_swap.list_loras()

    def sleep(self, level: int = 1) -> None:
        """Free the workers' weight memory for a colocated trainer. Level 1 keeps a host copy
        (wake-up restores it); level 2 keeps nothing (wake-up reloads the model folder's weights and
        resets `weight_version` to 0: push the trainer's weights again). Generating while asleep is
        an error; sleeping deeper is allowed, sleeping again at the same level does nothing."""
        self._check_open()
        with self._swap_failures_are_fatal():
            self.hot_swap.sleep(level, unfinished=len(self.scheduler.requests))

    def wake_up(self) -> None:
        """Restore the weights after `sleep`; does nothing when awake."""
        self._check_open()
        with self._swap_failures_are_fatal():
            self.hot_swap.wake_up()

    @property
    def weight_version(self) -> int:
        """The version of the weights (and adapters) the next steps run with."""
        return self.hot_swap.weight_version

    @property
    def sleep_level(self) -> int:
        """0 when awake, else the level `sleep` was called with."""
        return self.hot_swap.sleep_level

    # Worker functions.

    def collective_rpc(
        self,
        method: str | Callable,
        args: Sequence = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """Run a worker method (by name, an extension method, or `fn(worker, *args, **kwargs)`)
        on every rank, or on `ranks`; one result per rank, in rank order. Runs between engine
        steps, never inside one."""
        self._check_open()
        start = time.perf_counter()
        results = self._on_executor(
            self.executor.collective_rpc, method, args=args, kwargs=kwargs, timeout=timeout, ranks=ranks
        )
        if self._step_observers:
            wall_s = time.perf_counter() - start
            name = name_on_the_wire(self.executor.worker_cls, method) or getattr(method, "__qualname__", repr(method))
            self._notify(StepReport(kind="rpc", name=name, wall_s=wall_s, execute_s=wall_s))
        return results

    def check_health(self) -> None:
        """Raise if a worker cannot serve (EngineDeadError once one is gone)."""
        self._check_open()
        self._on_executor(self.executor.check_health)

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine can no longer serve (a worker is gone), or None."""
        return self._dead

    # Lifetime.

    def shutdown(self) -> None:
        """Stop the workers; later calls raise RuntimeError. Calling it again does nothing."""
        if not self._closed:
            self._closed = True
            self.executor.shutdown()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # Internals.

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._closed:
            raise RuntimeError("this RolloutEngine is shut down; create a new one")

    def _check_awake(self) -> None:
        self.hot_swap.check_awake()

    def _apply_update(self, update: WeightUpdate) -> int:
        """Send a weight update `HotSwap` has checked whole: with mode "wait", once the running
        requests have finished on the old weights (their outputs kept for the next `step()`)."""
        if update.mode == "wait":
            self._finish_running_requests()
        with self._swap_failures_are_fatal():
            return self.hot_swap.apply_update(update)

    @contextmanager
    def _swap_failures_are_fatal(self) -> Iterator[None]:
        """A hot swap whose commit or rollback failed may leave ranks that disagree (which weights,
        which adapter, which sleep level); `HotSwap` raises EngineDeadError for it, and the engine
        stops serving here, failing its requests."""
        try:
            yield
        except EngineDeadError as error:
            self._die(error)
            raise

    def _on_executor(self, call: Callable, *args, **kwargs):
        """Run an executor call; if the workers are gone (dead, or stopped by an interrupt in the
        middle of a step), fail every request at once and stay dead."""
        try:
            return call(*args, **kwargs)
        except EngineDeadError as error:
            self._die(error)
            raise
        except BaseException:
            if self.executor.dead is not None:  # e.g. Ctrl-C during a step: the executor stopped
                self._die(EngineDeadError(self.executor.dead))
            raise

    @contextmanager
    def _interrupts_are_fatal(self) -> Iterator[None]:
        """Ctrl-C (or SystemExit) inside a step can land between the scheduler's, the requests'
        and the workers' updates and leave them out of step: the engine stops its workers and is
        dead, wherever in the step it landed (one rule, not a race the caller has to read)."""
        try:
            yield
        except Exception:
            raise
        except BaseException as error:
            if self._dead is None:
                self.executor.kill(interrupted_reason(error))
                self._die(EngineDeadError(self.executor.dead))
            raise

    def _die(self, error: EngineDeadError) -> None:
        self._dead = error
        lost = self.scheduler.abort_all()  # nobody is left to free their worker state
        if lost:
            logger.error("engine is dead; %d unfinished requests failed: %s", len(lost), error)

    def _params_per_prompt(self, prompts, params) -> list[SamplingParams]:
        if len(prompts) == 0:
            raise ValueError("prompts is empty; pass at least one prompt")
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt"
            )
        return params

    def _check_request(self, prompt: str, params: SamplingParams, sizes: tuple = ()) -> SamplingParams:
        """Check what depends on the model (`_request_problems`) and the adapter `params` names;
        returns `params` with the model's defaults filled in."""
        resolved, problems = self._request_problems(prompt, params, sizes)
        problems += self._lora_problems(params)
        if problems:
            raise ValueError("invalid request: " + "; ".join(problems))
        return resolved

    def _lora_problems(self, params: SamplingParams) -> list[str]:
        if params.lora is None or self.hot_swap.has_lora(params.lora):
            return []
        return [f"lora {params.lora!r} is not loaded; loaded: {self.list_loras()} (see load_lora)"]

    def _request_problems(
        self, prompt: str, params: SamplingParams, sizes: tuple[tuple[int, int], ...]
    ) -> tuple[SamplingParams, list[str]]:
        """What the model's rules and this engine's limits find wrong with one prompt's request
        whose input images have these (height, width) sizes (none: text only), and `params` with
        the model's defaults filled in (an edit's size, where it sets none, from its input images:
        `ModelSpec.edit_size`). It reads only what never changes, so any thread may ask."""
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str, got {type(prompt).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        spec = self.model_spec
        image_problems = self._image_problems(sizes)
        if sizes and not image_problems and (params.height is None or params.width is None):
            height, width = spec.edit_size(sizes, auto_resize=spec.auto_resizes(params))
            params = dataclasses.replace(
                params,
                height=params.height if params.height is not None else height,
                width=params.width if params.width is not None else width,
            )
        resolved, problems = self._resolve(params)
        problems = image_problems + list(problems)  # the cached list stays as it was
        if not image_problems:
            problems += spec.first_frame_size_problems(sizes, params)
        if not problems:  # the limits read the sizes the model's rules checked
            encoded = spec.encoded_image_pixels(sizes, spec.auto_resizes(resolved)) if sizes else ()
            problems += self.config.request_limits.problems(prompt, resolved, spec, encoded)
            if not problems:  # and what the work of a request of these sizes would take
                problems += self.work_budget.problems(resolved, encoded)
        return resolved, problems

    def _image_problems(self, sizes: tuple[tuple[int, int], ...]) -> list[str]:
        """The model's rules for one prompt's input images of these (height, width) sizes."""
        problems = self.model_spec.image_problems(sizes)
        if sizes and not self.model_spec.max_input_images:
            from rollout.pipelines.families import edit_families_help

            problems = [f"{problems[0]} (families that take images: {edit_families_help()})"]
        return problems

    def _finish_running_requests(self) -> None:
        """Step the admitted requests to the end (admitting no new ones); keep their outputs for
        the next `step()`."""
        while self.scheduler.running:
            self._stashed_outputs += self._step_once(admit=False)

    def _flush_frees(self) -> None:
        """Send pending frees now, so aborted requests leave no worker state behind."""
        frees = self.scheduler.take_frees()
        if not frees.is_empty:
            for rank, runner_output in enumerate(self._on_executor(self.executor.execute, frees)):
                self._received_conditions.attach(rank, runner_output)  # what the frees released

    def _make_output(
        self,
        request: Request,
        finished: FinishedRequest | None,
        leaf: NodeId | None = None,
        error: str | None = None,
    ) -> RolloutOutput:
        """The output of `request` (`finished` by a worker, or None when aborted), or of one of its
        future leaves (aborted, or failed with `error`)."""
        now = time.monotonic()
        first = request.first_step_time
        node_id = leaf if leaf is not None else request.node_id
        return RolloutOutput(
            node_id=node_id,
            prompt=request.prompt,
            prompt_index=request.prompt_index,
            seed=request.leaf_seed(node_id.branch_path),
            status=_status(request, leaf, error),
            image=finished.image if finished is not None else None,
            video=finished.video if finished is not None else None,
            audio=finished.audio if finished is not None else None,
            audio_sample_rate=self.model_spec.audio_sample_rate
            if finished is not None and finished.audio is not None
            else None,
            latents=finished.latents if finished is not None else None,
            trajectory=finished.trajectory if finished is not None else None,
            weight_version=request.weight_versions[-1] if request.weight_versions else self.weight_version,
            weight_versions=request.weight_versions,
            step_weight_versions=tuple(request.step_versions),
            lora=request.params.lora,
            timings=RequestTimings(
                queued_s=(first or now) - request.arrival_time,
                denoise_s=now - first if first is not None else 0.0,
                total_s=now - request.arrival_time,
            ),
            error=error,
        )


def _node_named(target: str) -> NodeId | None:
    """The node an abort target names, or None for a group id (or an id of no form)."""
    try:
        return NodeId.parse(target)
    except ValueError:
        return None


def _status(request: Request, leaf: NodeId | None, error: str | None) -> str:
    if error is not None:
        return "failed"
    return "aborted" if leaf is not None or request.status is RequestStatus.ABORTED else "finished"
