"""The trainer-facing engine API, declared once.

`RolloutAPI` is what a trainer calls: `RolloutEngine` (in process) and `RemoteRolloutEngine` (a
rollout server over HTTP) both conform to it with these exact signatures, so a trainer switches
front by configuration. `AsyncRolloutAPI` is its twin for asyncio callers (same names, coroutines),
which `AsyncRolloutEngine` conforms to. tests/test_api.py holds the three fronts to these.

An implementation may add keyword-only parameters with defaults (hooks its own callers use, such as
`RolloutEngine.step(admit=...)`) and members of its own; it may not change these.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig

    from rollout.config import EngineConfig
    from rollout.model_spec import ModelSpec
    from rollout.outputs import RolloutOutput
    from rollout.sampling_params import SamplingParams

# The defaults the fronts share, named once: the component a weight update or a checksum concerns
# (the denoiser, in every family's pipeline), and the size of a weight transfer's buckets.
DEFAULT_COMPONENT = "transformer"
DEFAULT_BUCKET_BYTES = 512 * 2**20


def implements(declaration: Callable) -> Callable[[Callable], Callable]:
    """Decorate an implementation of a declared call that lists its parameters' names only (the
    declaration's, of the same kinds, in its order; else a TypeError at import): it takes the
    declaration's defaults and signature (annotations and defaults written once, here), and is
    called as it is, without a wrapper. Its own docstring stays (the declaration's if none)."""
    signature = inspect.signature(declaration)
    parameters = list(signature.parameters.values())
    declared = [(p.name, p.kind) for p in parameters]

    def decorate(implementation: Callable) -> Callable:
        listed = [(p.name, p.kind) for p in inspect.signature(implementation).parameters.values()]
        if listed != declared:
            raise TypeError(
                f"{implementation.__qualname__}{inspect.signature(implementation)} does not list {signature}"
            )
        positional = (p.default for p in parameters if p.kind <= p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)
        implementation.__defaults__ = tuple(positional) or None
        keyword = {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}
        implementation.__kwdefaults__ = keyword or None
        implementation.__signature__ = signature
        implementation.__doc__ = implementation.__doc__ or declaration.__doc__
        return implementation

    return decorate


def ranks_list(ranks: Sequence[int] | None) -> list[int] | None:
    """`collective_rpc`'s `ranks` as a list (None stays None: every rank), checked on every front:
    TypeError unless it is a sequence of ints, ValueError for a rank named twice. Which ranks
    exist is the engine's to check."""
    if ranks is None:
        return None
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Iterable):
        raise TypeError(f"ranks must be a list of rank numbers (e.g. [{ranks!r}]), or None for all, got {ranks!r}")
    ranks = list(ranks)
    if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
        raise TypeError(f"ranks must be a list of rank numbers (ints), got {ranks!r}")
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise ValueError(f"ranks names {twice} more than once (got {ranks}); name each rank once")
    return ranks


@runtime_checkable
class RolloutAPI(Protocol):
    """Generation, incremental driving, worker functions and the hot-swap API of one engine."""

    config: EngineConfig
    model_spec: ModelSpec

    @property
    def weight_version(self) -> int:
        """The version the next steps' weights (and adapters) carry."""

    @property
    def sleep_level(self) -> int:
        """0 when awake, else the level of the last `sleep`."""

    # Generation.

    def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        images: Sequence | None = None,
        use_tqdm: bool = False,
    ) -> list[RolloutOutput]:
        """`num_samples` samples per prompt (one params for all prompts, or one per prompt); outputs
        ordered by prompt, then sample (then branch path). `images`: an edit family's input images,
        one list per prompt (uint8 [3, H, W] tensors or PIL images; None for a text-only prompt)."""

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
        """Queue one prompt's samples without running them (with its input images, for an edit
        family); returns the ids of their outputs, which `step()` returns as they finish."""

    def step(self) -> list[RolloutOutput]:
        """Advance the queued requests; returns the outputs that finished."""

    def abort(self, request_ids: str | Iterable[str]) -> list[RolloutOutput]:
        """Abort by sample, group or branch id; their worker state is freed before this returns.
        One output with status "aborted" per leaf aborted; unknown ids are ignored."""

    def has_unfinished_requests(self) -> bool:
        """Whether any request added is not finished yet (its output not returned)."""

    # Worker functions.

    def collective_rpc(
        self,
        method: str | Callable,
        args: Sequence = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """A worker method (by name, or a callable in process) on every rank or on `ranks`; one
        result per rank, in rank order."""

    def check_health(self) -> None:
        """Raise if a worker cannot serve."""

    # Weights.

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
        """Replace weights of `component` on every worker, all or nothing; returns the new version."""

    def update_weights_from_disk(
        self,
        path: str | Path,
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        check_finite: bool = True,
    ) -> int:
        """`update_weights` from a .safetensors file or a component folder the workers read."""

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
        """`update_weights` with tensors every worker reads itself: the `@stages_weights` worker
        function `method` returns or yields them (`rollout.worker.marks`)."""

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> list[int]:
        """Join a trainer's broadcast group; returns the workers' group ranks."""

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
        """`update_weights` with tensors the trainer broadcasts through the group."""

    def check_weight_update(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[tuple[int, ...]],
        component: str = DEFAULT_COMPONENT,
    ) -> None:
        """Raise ValueError if an update with these tensors would be refused."""

    def weights_checksum(self, component: str = DEFAULT_COMPONENT) -> str:
        """SHA-256 of every weight of `component`; raises if the ranks disagree."""

    # LoRA adapters.

    def load_lora(
        self,
        name: str,
        source: str | Path | Mapping[str, torch.Tensor],
        config: LoraConfig | Mapping | None = None,
        *,
        version: int | None = None,
        check_finite: bool = True,
    ) -> int:
        """Load adapter `name` on every worker (or hot-swap it); returns the new weight version."""

    def unload_lora(self, name: str) -> None:
        """Remove adapter `name` from every worker and free its memory."""

    def lora_modules(self, name: str) -> int:
        """How many modules adapter `name` binds."""

    def list_loras(self) -> list[str]:
        """Names of the loaded LoRA adapters, sorted."""

    # Memory.

    def sleep(self, level: int = 1) -> None:
        """Free the workers' weight memory (1: offload, 2: discard)."""

    def wake_up(self) -> None:
        """Restore the weights after `sleep`; does nothing when awake."""

    # Lifetime.

    def shutdown(self) -> None:
        """Stop the engine (or close the connection to it); calls after it raise."""


@runtime_checkable
class AsyncRolloutAPI(Protocol):
    """`RolloutAPI` for asyncio callers: the same calls as coroutines, many callers at once,
    outputs streamed as they finish, and pausing."""

    async def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        images: Sequence | None = None,
    ) -> list[RolloutOutput]:
        """`RolloutAPI.generate`, as a coroutine, sharing batches with other callers' requests."""

    def generate_stream(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        images: Sequence | None = None,
    ) -> AsyncIterator[RolloutOutput]:
        """`generate`, yielding each output as it finishes."""

    async def pause(self, mode: str = "abort") -> None:
        """Stop stepping: "abort" the unfinished requests, "wait" for the running ones, or "keep" them."""

    async def resume(self) -> None:
        """Step again after `pause`."""

    # The rest are `RolloutAPI`'s calls as they are (signatures and meaning), as coroutines.

    async def abort(self, request_ids: str | Iterable[str]) -> list[RolloutOutput]:
        """`RolloutAPI.abort`, as a coroutine."""

    async def collective_rpc(
        self,
        method: str | Callable,
        args: Sequence = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """`RolloutAPI.collective_rpc`, as a coroutine."""

    async def check_health(self) -> None:
        """`RolloutAPI.check_health`, as a coroutine."""

    async def update_weights(
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
        """`RolloutAPI.update_weights`, as a coroutine."""

    async def update_weights_from_disk(
        self,
        path: str | Path,
        *,
        component: str = DEFAULT_COMPONENT,
        version: int | None = None,
        mode: str = "wait",
        check_finite: bool = True,
    ) -> int:
        """`RolloutAPI.update_weights_from_disk`, as a coroutine."""

    async def update_weights_from_worker(
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
        """`RolloutAPI.update_weights_from_worker`, as a coroutine."""

    async def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> list[int]:
        """`RolloutAPI.init_weight_update_group`, as a coroutine."""

    async def update_weights_from_distributed(
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
        """`RolloutAPI.update_weights_from_distributed`, as a coroutine."""

    async def check_weight_update(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[tuple[int, ...]],
        component: str = DEFAULT_COMPONENT,
    ) -> None:
        """`RolloutAPI.check_weight_update`, as a coroutine."""

    async def weights_checksum(self, component: str = DEFAULT_COMPONENT) -> str:
        """`RolloutAPI.weights_checksum`, as a coroutine."""

    async def load_lora(
        self,
        name: str,
        source: str | Path | Mapping[str, torch.Tensor],
        config: LoraConfig | Mapping | None = None,
        *,
        version: int | None = None,
        check_finite: bool = True,
    ) -> int:
        """`RolloutAPI.load_lora`, as a coroutine."""

    async def unload_lora(self, name: str) -> None:
        """`RolloutAPI.unload_lora`, as a coroutine."""

    async def sleep(self, level: int = 1) -> None:
        """`RolloutAPI.sleep`, as a coroutine."""

    async def wake_up(self) -> None:
        """`RolloutAPI.wake_up`, as a coroutine."""

    def shutdown(self) -> None:
        """`RolloutAPI.shutdown` (not a coroutine: it may run where no event loop does)."""
