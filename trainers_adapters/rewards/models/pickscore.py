"""PickScore (Kirstain et al., "Pick-a-Pic", arXiv 2305.01569): a CLIP-H fine-tuned on human
preferences, yuvalkirstain/PickScore_v1, with the processor of laion/CLIP-ViT-H-14-laion2B-s32B-b79K.

As the model card computes it: images as PIL images and prompts through the processor with
`padding=True, truncation=True, max_length=77`, both embeddings L2-normalised, score
`logit_scale.exp() * text_embeds @ image_embeds.T`; here each image against its own prompt (the
diagonal). The raw score (around 20-23 for real images) is the default; Flow-GRPO's PickScore
reward divides it by 26, which is `scale: 0.03846` (1/26).
"""

from __future__ import annotations

import torch

from trainers_adapters.rewards.models.clip import ClipRewardModel, normalised, to_pil


class PickScore(ClipRewardModel):
    """PickScore of each image against its own prompt, times `scale`.

    model: the PickScore_v1 folder; processor: the CLIP-H processor's folder (the model card loads
    them from two repos); scale: a factor on the raw score (1/26: Flow-GRPO's)."""

    name = "pickscore"

    def __init__(
        self,
        model: str,
        processor: str | None = None,
        device: str = "cpu",
        batch_size: int = 32,
        scale: float = 1.0,
    ):
        super().__init__(model, processor, device, batch_size)
        self.scale = scale

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        pixels = self.processor(
            images=to_pil(images), padding=True, truncation=True, max_length=77, return_tensors="pt"
        )["pixel_values"]
        tokens = self.processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        image_embeds = normalised(self.image_features(pixels))
        text_embeds = normalised(self.text_features(tokens))
        scores = self.model.logit_scale.exp() * (text_embeds * image_embeds).sum(dim=-1)
        return self.scale * scores
