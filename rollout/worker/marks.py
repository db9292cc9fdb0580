"""Marks on worker functions: what a function does to the state the engine keeps.

A worker function (a `Worker` method, or one of a `worker_extension_cls`) may change what the
engine keeps a record of (weights and their version, adapters, sleep level, requests) without the
engine knowing. The mark says which it is, where the function is written:

- `@read_only`: it only reads. The service lets any client holding its key call it by name
  (`/collective_rpc`); an unmarked function is callable there only with `--rpc-allow NAME`.
- `@stages_weights`: it reads a weight update from its own source (shared memory, a file, a
  collective of its own) and returns, or yields, the (name, tensor) pairs of one component. The
  engine runs it on every rank through `update_weights_from_worker`, checks and stages what it
  returns, and applies the update on every rank or on none, with a new weight version, as
  `update_weights` does. Calling it through `collective_rpc` is refused: nothing would be applied.

The worker's own functions carry one mark each too (a test holds every public `Worker` method to
it), and what the engine and the service do with them derives from the marks alone:

- `@step`: the engine step (`Worker.execute`). It runs with a merged LoRA adapter left in place,
  as the read-only functions do (`rollout.worker.worker.call_function`); over HTTP it is
  `generate`.
- `@engine_route("load_lora")`: it changes what the engine keeps, and only the engine's own method
  of that name (`RolloutAPI`) calls it with the bookkeeping; `/collective_rpc` refuses it and
  names that method's route instead.

(One decorator per kind rather than one `worker_function(kind=, route=)`: a route belongs to the
engine's kinds alone, and a user's extension keeps writing the two marks it has.)

    class MyWorkerFunctions:
        @read_only
        def latent_norms(self) -> dict[str, float]: ...

        @stages_weights
        def weights_from_shm(self, handle: str):
            yield from read_my_shared_memory(handle, device=self.adapter.device)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

Function = TypeVar("Function", bound=Callable)

READ_ONLY = "read_only"
STAGES_WEIGHTS = "stages_weights"
STEP = "step"
ENGINE_ROUTE = "engine_route"
_MARK = "__worker_function_mark__"
_ROUTE = "__worker_function_route__"


def read_only(function: Function) -> Function:
    """Mark a worker function that changes nothing the engine keeps (see the module docstring)."""
    return _marked(function, READ_ONLY)


def stages_weights(function: Function) -> Function:
    """Mark a worker function that returns or yields the (name, tensor) pairs of a weight update,
    for `update_weights_from_worker` (see the module docstring)."""
    return _marked(function, STAGES_WEIGHTS)


def step(function: Function) -> Function:
    """Mark the worker's engine step (`Worker.execute`; its route is the engine's `generate`)."""
    return _routed(_marked(function, STEP), "generate")


def engine_route(api_method: str) -> Callable[[Function], Function]:
    """Mark a worker's own function that changes what the engine keeps; `api_method`: the engine
    method (`RolloutAPI`) that calls it and keeps the engine's record of what it did."""

    def mark(function: Function) -> Function:
        return _routed(_marked(function, ENGINE_ROUTE), api_method)

    return mark


def mark_of(function: Callable) -> str | None:
    """`READ_ONLY`, `STAGES_WEIGHTS`, `STEP`, `ENGINE_ROUTE`, or None for an unmarked function."""
    return getattr(function, _MARK, None)  # an unmarked function has no such attribute


def route_of(function: Callable) -> str | None:
    """The engine method a `@step` or `@engine_route` function is reached through, else None."""
    return getattr(function, _ROUTE, None)  # only those two marks set it


def _marked(function: Function, mark: str) -> Function:
    other = mark_of(function)
    if other not in (None, mark):
        raise TypeError(f"{function.__qualname__} is marked {other}; a worker function has one mark")
    setattr(function, _MARK, mark)
    return function


def _routed(function: Function, api_method: str) -> Function:
    setattr(function, _ROUTE, api_method)
    return function


def worker_functions(worker_cls: type) -> set[str]:
    """The worker functions of a worker class: its public callables."""
    return {name for name in dir(worker_cls) if not name.startswith("_") and callable(getattr(worker_cls, name))}


def name_on_the_wire(worker_cls: type, method: str | Callable) -> str | None:
    """The name a worker function travels under to the workers, who look it up on their class:
    `method` itself for a name; its name for a reference to a function of `worker_cls`
    (`Worker.stage_weights`, a method of the `worker_extension_cls`), so an engine names its
    calls by reference and still sends a name; None for any other callable (sent whole)."""
    if isinstance(method, str):
        return method
    name = getattr(method, "__name__", None)  # a callable object may have none: it is sent whole
    return name if isinstance(name, str) and getattr(worker_cls, name, None) is method else None


def functions_marked(worker_cls: type, mark: str) -> frozenset[str]:
    """The worker functions of `worker_cls` that carry `mark`."""
    return frozenset(name for name in worker_functions(worker_cls) if mark_of(getattr(worker_cls, name)) == mark)


def engine_routes(worker_cls: type) -> dict[str, str]:
    """worker function name -> the engine method it is reached through, for the functions of
    `worker_cls` that have one (`@step`, `@engine_route`)."""
    functions = {name: getattr(worker_cls, name) for name in sorted(worker_functions(worker_cls))}
    return {name: route_of(function) for name, function in functions.items() if route_of(function) is not None}


def staging_function(worker_cls: type, method: str) -> Callable:
    """The `@stages_weights` function named `method` on `worker_cls`, for
    `update_weights_from_worker`; ValueError (TypeError for a name that is not a string) otherwise."""
    if not isinstance(method, str):
        raise TypeError(
            f"update_weights_from_worker takes the name of a @stages_weights worker function, got {method!r}: "
            "write it as a method of worker_extension_cls, so that every rank has it"
        )
    staging = sorted(functions_marked(worker_cls, STAGES_WEIGHTS))
    if method not in staging:
        known = method in worker_functions(worker_cls)
        what = "is not marked @stages_weights" if known else "is not a worker function"
        raise ValueError(
            f"worker function {method!r} {what}; the ones that stage weights: {staging or 'none'} (mark a method "
            "of worker_extension_cls with rollout.worker.marks.stages_weights; it returns or yields the "
            "(name, tensor) pairs of the update)"
        )
    return getattr(worker_cls, method)
