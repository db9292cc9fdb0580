"""The LAION aesthetic predictor v2 (christophschuhmann/improved-aesthetic-predictor): a linear MLP
head over L2-normalised CLIP ViT-L/14 image embeddings, trained to predict AVA-style ratings (1-10).

The head is that repository's `MLP` (the `sac+logos+ava1-l14-linearMSE` weights): Linear(768, 1024),
Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64), Dropout(0.1), Linear(64, 16),
Linear(16, 1), no activations; its layers keep the published state-dict names (`layers.0`,
`layers.2`, `layers.4`, `layers.6`, `layers.7`), so the published weights load once saved as
safetensors. The image path is DDPO's aesthetic scorer (ddpo-pytorch `aesthetic_scorer.py`,
which Flow-GRPO reuses): uint8 images through the CLIPProcessor of openai/clip-vit-large-patch14,
`get_image_features`, divided by their L2 norm, then the head.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from trainers_adapters.rewards.models.clip import ClipRewardModel, normalised


def aesthetic_head(embed_dim: int = 768) -> nn.Sequential:
    """The LAION v2 head over `embed_dim` features (768: CLIP ViT-L/14), in eval mode."""
    return nn.Sequential(
        nn.Linear(embed_dim, 1024),
        nn.Dropout(0.2),
        nn.Linear(1024, 128),
        nn.Dropout(0.2),
        nn.Linear(128, 64),
        nn.Dropout(0.1),
        nn.Linear(64, 16),
        nn.Linear(16, 1),
    ).eval()


class AestheticScore(ClipRewardModel):
    """LAION aesthetic score of each image (the prompt is not used).

    model: a CLIP ViT-L/14 folder (any CLIPModel whose projection width the head takes); head: a
    safetensors file of the head's state dict, its keys prefixed `layers.` as published."""

    name = "aesthetic"

    def __init__(self, model: str, head: str, processor: str | None = None, device: str = "cpu", batch_size: int = 32):
        super().__init__(model, processor, device, batch_size)
        state = {key.removeprefix("layers."): tensor for key, tensor in load_file(head).items()}
        self.head = aesthetic_head(self.model.config.projection_dim)
        self.head.load_state_dict(state)  # strict: a head for another width or layout is refused by name
        self.head.to(self.device)

    @classmethod
    def settings_problems(cls, settings: dict) -> list[str]:
        problems = super().settings_problems(settings)
        head = settings.get("head")
        if isinstance(head, str) and not Path(head).is_file():
            problems.append(f"head {head!r} is not a file (the head's weights as safetensors)")
        return problems

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        pixels = self.processor(images=list(images), return_tensors="pt")["pixel_values"]
        return self.head(normalised(self.image_features(pixels))).squeeze(1)


def save_aesthetic_head(head: nn.Sequential, path: str | Path) -> Path:
    """Write `head`'s weights as safetensors with the published key names (`layers.0.weight`, ...)."""
    path = Path(path)
    save_file({f"layers.{key}": tensor.contiguous() for key, tensor in head.state_dict().items()}, path)
    return path
