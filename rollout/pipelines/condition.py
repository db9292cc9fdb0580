"""Prompt conditioning that travels with a trajectory, so a trainer never re-encodes text."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Condition:
    """Text conditioning of one sample (unbatched) or of a batch (leading dim B).

    prompt_embeds: [L, D]; pooled_prompt_embeds: [P]; the negative_* pair is the unconditional
    branch of classifier-free guidance (the empty prompt).
    """

    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor
    negative_pooled_prompt_embeds: torch.Tensor

    @staticmethod
    def stack(conditions: list[Condition]) -> Condition:
        """Batch per-sample conditions along a new leading dim."""
        return Condition(
            prompt_embeds=torch.stack([c.prompt_embeds for c in conditions]),
            pooled_prompt_embeds=torch.stack([c.pooled_prompt_embeds for c in conditions]),
            negative_prompt_embeds=torch.stack([c.negative_prompt_embeds for c in conditions]),
            negative_pooled_prompt_embeds=torch.stack([c.negative_pooled_prompt_embeds for c in conditions]),
        )

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Condition:
        return Condition(
            prompt_embeds=self.prompt_embeds.to(device, dtype),
            pooled_prompt_embeds=self.pooled_prompt_embeds.to(device, dtype),
            negative_prompt_embeds=self.negative_prompt_embeds.to(device, dtype),
            negative_pooled_prompt_embeds=self.negative_pooled_prompt_embeds.to(device, dtype),
        )
