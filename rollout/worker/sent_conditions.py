"""The worker's side of sending text embeddings (and an edit's encoded input images) to the engine
once, not with every finished sample; the engine's side is `rollout.engine.received_conditions`.

Every finished trajectory carries the embeddings of its prompt and negative prompt, but the samples
of a prompt (and every sample with the same negative prompt) finish over many steps, and sending
the same tensors with each was most of what a finishing step's reply carried (the tiny SD3's two
texts are 170 KiB; its image and latents ~100 KiB). So a worker numbers an embeddings object the
first time a sample finishes with it and sends its CPU copy once, in that step's reply; later
samples carry only the number (`ConditionKeys`). The worker keeps the number while a live request
still uses the object, and the reply of the step in which none does any more releases it; the
engine (`rollout.engine.received_conditions.ReceivedConditions`) keeps the copy exactly that long,
so a number never outlives what it names. Both sides change only in `Worker.execute` and in the
engine's reading of its reply, one reply at a time and in order, which is what keeps them in step
on every executor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from rollout.condition import Condition, PromptEmbeds
from rollout.messages import ConditionKeys


class SentConditions:
    """The worker's side: which of its embeddings objects the engine holds, by number."""

    def __init__(self):
        # id(embeds) -> (number, embeds); holding the object keeps its id from naming another one.
        self._numbered: dict[int, tuple[int, PromptEmbeds]] = {}
        self._numbers = itertools.count()
        self._unsent: dict[int, PromptEmbeds] = {}  # number -> CPU float32 copy, for this step's reply

    def __len__(self) -> int:
        """How many embeddings objects are numbered (the engine holds a copy of each)."""
        return len(self._numbered)

    def keys(self, condition: Condition) -> ConditionKeys:
        """The numbers of `condition`'s embeddings, numbering (and queueing to send) new ones."""
        return ConditionKeys(
            **{name: None if part is None else self._number(part) for name, part in condition.parts().items()}
        )

    def reply(self, live: Iterable[Condition]) -> tuple[dict[int, PromptEmbeds], tuple[int, ...]]:
        """What this step's reply carries: the embeddings numbered since the last reply (number ->
        CPU float32 copy), and the numbers that no condition in `live` (those of the requests the
        worker still holds) uses any more, which both sides forget now."""
        sent, self._unsent = self._unsent, {}
        if not self._numbered:
            return sent, ()
        used = {id(embeds) for condition in live for embeds in condition.parts().values()}
        released = tuple(self._numbered.pop(held)[0] for held in list(self._numbered) if held not in used)
        return sent, released

    def _number(self, embeds: PromptEmbeds) -> int:
        held = self._numbered.get(id(embeds))
        if held is None:
            held = self._numbered[id(embeds)] = (next(self._numbers), embeds)
            self._unsent[held[0]] = embeds.to("cpu", torch.float32)
        return held[0]
