"""What a `HotSwap` (`rollout.engine.hot_swap`) asks of the engine it serves: the engine's own
decisions, typed, instead of loose callables."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rollout.engine.request import Request
    from rollout.errors import EngineDeadError


class EngineControl(Protocol):
    """What a `HotSwap` asks of its engine, which alone decides it: the engine's requests and its
    life are its own (`RolloutEngine` gives one). Drains and deaths come in the middle of a hot
    swap's protocol (a LoRA is staged on every rank before the running requests are drained, so
    a refusal answers at once; ranks that may disagree after a failed commit end the engine), so
    they are asked for there rather than sequenced around it."""

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None, ranks=None) -> list[Any]:
        """The engine's call of a worker function on every rank (`RolloutAPI.collective_rpc`'s
        arguments): refused once the engine is shut down or dead, the engine's death where the
        workers are gone, seen by its step observers."""

    def check_open(self) -> None:
        """Raise if the engine is shut down or dead."""

    def finish_running_requests(self) -> None:
        """Step the running requests to the end (their outputs kept for the next step)."""

    def die(self, error: EngineDeadError) -> None:
        """Mark the engine dead with `error` and fail its requests."""

    def unfinished_requests(self) -> Collection[Request]:
        """The engine's unfinished requests."""
