"""CLIP score (Hessel et al., "CLIPScore", arXiv 2104.08718), as torchmetrics computes it.

The score of an image and its prompt is `100 * cos(E_image, E_text)` clipped at 0, the definition
torchmetrics' `clip_score` documents (the paper's CLIP-S is `w * max(cos, 0)` with w = 2.5;
torchmetrics scales by 100). torchmetrics clips the mean of a batch; a reward scores each sample,
so here each sample's score is clipped. Preprocessing follows torchmetrics'
`functional/multimodal/clip_score.py`: the images go to the processor as uint8 tensors, the
prompts with `padding=True`, and token ids beyond the text model's `max_position_embeddings` are cut
off. torchmetrics' default model is openai/clip-vit-large-patch14.
"""

from __future__ import annotations

import torch

from trainers_adapters.rewards.models.clip import ClipRewardModel, normalised


class ClipScore(ClipRewardModel):
    """CLIP score in [0, 100] of each image against its own prompt."""

    name = "clip_score"

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        pixels = self.processor(images=list(images), return_tensors="pt", padding=True)["pixel_values"]
        tokens = self.processor(text=prompts, return_tensors="pt", padding=True)
        limit = self.model.config.text_config.max_position_embeddings
        tokens = {key: tokens[key][..., :limit] for key in ("input_ids", "attention_mask")}
        cosine = (normalised(self.image_features(pixels)) * normalised(self.text_features(tokens))).sum(dim=-1)
        return (100 * cosine).clamp(min=0)
