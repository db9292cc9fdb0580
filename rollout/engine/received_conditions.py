"""The engine's side of the text embeddings a worker sends once (`rollout.worker.sent_conditions`
says how the numbering works): it keeps each rank's copies by number until that rank's reply
releases them, and gives every finished trajectory its condition from them. It runs in the
engine's process, one reply at a time and in order.
"""

from __future__ import annotations

import dataclasses

from rollout.condition import Condition, PromptEmbeds
from rollout.messages import ConditionKeys, RunnerOutput


class ReceivedConditions:
    """The engine's side: per rank, the embeddings its worker sent, by number, until released."""

    def __init__(self, num_ranks: int):
        self._by_rank: list[dict[int, PromptEmbeds]] = [{} for _ in range(num_ranks)]

    def attach(self, rank: int, runner_output: RunnerOutput) -> None:
        """Give every trajectory in `runner_output` (a `rollout.messages.RunnerOutput` of `rank`) its
        condition, then forget the numbers the reply released."""
        held = self._by_rank[rank]
        held |= runner_output.embeds
        for finished in runner_output.finished:
            if finished.trajectory is not None:
                finished.trajectory.condition = self._condition(rank, held, finished.condition)
        for number in runner_output.released_embeds:
            del held[number]

    @staticmethod
    def _condition(rank: int, held: dict[int, PromptEmbeds], keys: ConditionKeys) -> Condition:
        numbers = dataclasses.asdict(keys)
        missing = [n for n in numbers.values() if n is not None and n not in held]
        if missing:
            raise RuntimeError(
                f"worker rank {rank} named text embeddings {missing} it never sent (an earlier reply of "
                "that rank was lost to an error); create a new engine"
            )
        return Condition(**{name: None if n is None else held[n] for name, n in numbers.items()})
