"""One conditioning object per text, however many steps and ranks a prompt's samples came from.

A worker encodes each text once and its finished samples reference that one object, but outputs
cross processes step by step and rank by rank, so the engine would still hold one copy per step and
rank. `SharedConditions` maps every arriving copy to the first one alive for the same text, text
length and weights (an edit's encoded images: the same images digest and weights), so the samples
of one prompt (and every sample with the same negative prompt, or the same input images) reference
one tensor on every executor. Entries live as long as some output references them.
"""

from __future__ import annotations

import weakref

from rollout.condition import Condition, PromptEmbeds
from rollout.engine.request import Request
from rollout.model_spec import ModelSpec


class SharedConditions:
    def __init__(self, spec: ModelSpec):
        # Texts keyed by `spec.text_key` (with the images' digest where the prompt's encoding reads
        # them) and the encoders' generation the request was encoded at (embeddings encoded before
        # and after a weight change are different objects).
        self._spec = spec
        self._alive: weakref.WeakValueDictionary[tuple, PromptEmbeds] = weakref.WeakValueDictionary()

    def share(self, request: Request, condition: Condition) -> Condition:
        """`condition` (of a finished `request`) with its embeddings replaced by the shared ones."""
        prompt = self._shared(request, request.prompt, condition.prompt)
        negative = condition.negative
        if negative is not None:
            negative = self._shared(request, request.params.negative_prompt, negative)
        images = condition.images
        if images is not None:
            images = self._alive.setdefault(("images", request.images.digest, request.encoder_generation), images)
        return Condition(prompt, negative, images)

    def _shared(self, request: Request, text: str, embeds: PromptEmbeds) -> PromptEmbeds:
        key = self._spec.text_key(text, request.params.max_sequence_length, request.images)
        return self._alive.setdefault((*key, request.encoder_generation), embeds)
