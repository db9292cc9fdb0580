"""Conditioning: a family's prompt embeddings, its encoded input images, and one sample's condition.

A trajectory carries its condition so a trainer never re-encodes text or images. Conditions are
shared, not copied: every sample of a prompt references one `PromptEmbeds`, every sample with the
same negative prompt another, and every sample with the same input images one encoding of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class PromptEmbeds:
    """Base of a family's text embeddings: a dataclass whose fields are tensors, for one prompt
    (unbatched) or a batch (leading dim B).

    Prompts of different token lengths differ in the fields named in `padded_fields` (dim 0 when
    unbatched); `stack` pads those with zeros to the longest, so the family keeps a mask among them
    (zero, i.e. False, marks padding). Any other field must have the same shape for every prompt.
    `stack` also keeps each row's own length (`lengths`), host data: a family that drops the
    padding reads it there rather than from the mask, which the host would have to wait for.
    """

    padded_fields: ClassVar[tuple[str, ...]] = ()
    # Each row's length along `padded_fields` before padding (a batch from `stack`), None otherwise.
    # Not a dataclass field: it is not a tensor, and travels with the batch only (`to` keeps it).
    lengths: ClassVar[tuple[int, ...] | None] = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> PromptEmbeds:
        """On `device`, with floating-point fields cast to `dtype` (when given); masks keep theirs."""
        moved = dataclasses.replace(
            self,
            **{
                name: t.to(device, dtype if dtype is not None and t.is_floating_point() else t.dtype)
                for name, t in self.tensors().items()
            },
        )
        moved.lengths = self.lengths
        return moved

    @classmethod
    def stack(cls, items: Sequence[PromptEmbeds]) -> PromptEmbeds:
        """Batch unbatched embeddings along a new leading dim, padding `padded_fields` to the longest."""
        batched = {}
        lengths = None
        for f in dataclasses.fields(cls):
            tensors = [getattr(item, f.name) for item in items]
            shapes = {t.shape for t in tensors}
            if f.name in cls.padded_fields:
                lengths = tuple(t.shape[0] for t in tensors)
            if len(shapes) > 1:
                if f.name not in cls.padded_fields:
                    raise ValueError(f"{cls.__name__}.{f.name} differs in shape between prompts: {sorted(shapes)}")
                length = max(t.shape[0] for t in tensors)
                tensors = [_pad(t, length) for t in tensors]
            batched[f.name] = torch.stack(tensors)
        stacked = cls(**batched)
        stacked.lengths = lengths
        return stacked


def _pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    if tensor.shape[0] == length:
        return tensor
    padding = tensor.new_zeros((length - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, padding])


@dataclass
class Condition:
    """One sample's conditioning: the embeddings of its prompt and, when it is sampled with
    classifier-free guidance, of its negative prompt (None without CFG); for an edit, its input
    images as the family encodes them (`PipelineAdapter.encode_images`: e.g. FLUX.1 Kontext's
    packed VAE latents and their position ids), which the unconditional pass of CFG reads too
    (None for a text-only request)."""

    prompt: PromptEmbeds
    negative: PromptEmbeds | None = None
    images: PromptEmbeds | None = None

    def parts(self) -> dict[str, PromptEmbeds | None]:
        """Its embeddings by field name ("prompt", "negative", "images"), None where absent."""
        return {"prompt": self.prompt, "negative": self.negative, "images": self.images}
