"""What the CLIP-based reward models share: loading a local `CLIPModel` folder and its processor
on a device, checking the images a rollout hands over, and scoring them in batches without grad.

Processors load with transformers' PIL backend (`backend="pil"`): the published scorers (PickScore's
model card, torchmetrics' CLIPScore, DDPO's aesthetic scorer) ran on the PIL image processor that
transformers had before its torchvision one, whose bicubic resize gives slightly different pixels.
With the PIL backend a uint8 tensor and the same image as a PIL image give identical pixel values,
so each class hands the processor what its published code hands it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image

logger = logging.getLogger(__name__)


class ClipRewardModel:
    """Base of the rewards over a CLIP model: `reward(images, prompts, metadata) -> [N] float32`.

    model: a local folder of a `CLIPModel` (config.json + weights); processor: the folder of its
    `CLIPProcessor` (preprocessor/tokenizer files), the model's folder when None; device: where
    the model runs (the scores come back on CPU); batch_size: images per forward pass.
    Subclasses set `name` and implement `score(images, prompts)` on one batch.
    """

    name = "clip"

    def __init__(self, model: str, processor: str | None = None, device: str = "cpu", batch_size: int = 32):
        from transformers import CLIPModel, CLIPProcessor

        if batch_size < 1:
            raise ValueError(f"{self.name}: batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.model = CLIPModel.from_pretrained(model).eval().to(self.device)
        self.processor = CLIPProcessor.from_pretrained(processor or model, backend="pil")
        logger.info("%s: loaded %s on %s", self.name, model, self.device)

    @classmethod
    def settings_problems(cls, settings: dict) -> list[str]:
        """What is wrong with the folders `settings` names, found without loading anything."""
        problems = []
        model, processor = settings.get("model"), settings.get("processor")
        if isinstance(model, str) and not (Path(model) / "config.json").is_file():
            problems.append(f"model {model!r} is not a CLIPModel folder (no config.json there)")
        if isinstance(processor, str) and not Path(processor).is_dir():
            problems.append(f"processor {processor!r} is not a folder")
        return problems

    def __call__(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        images = image_batch(images, self.name)
        if len(prompts) != len(images):
            raise ValueError(f"{self.name}: {len(images)} images but {len(prompts)} prompts; one prompt per image")
        scores = []
        with torch.no_grad():
            for start in range(0, len(images), self.batch_size):
                end = start + self.batch_size
                scores.append(self.score(images[start:end], list(prompts[start:end])).float().cpu())
        return torch.cat(scores)

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Scores [n] of one batch: images uint8 [n, 3, H, W] on CPU, one prompt each."""
        raise NotImplementedError

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The projected image embeddings [n, D], not normalised."""
        return self.model.get_image_features(pixel_values=pixel_values.to(self.device)).pooler_output

    def text_features(self, tokens) -> torch.Tensor:
        """The projected text embeddings [n, D] of the processor's `input_ids` / `attention_mask`."""
        return self.model.get_text_features(
            input_ids=tokens["input_ids"].to(self.device), attention_mask=tokens["attention_mask"].to(self.device)
        ).pooler_output


def image_batch(images, reward: str) -> torch.Tensor:
    """`images` as uint8 [N, 3, H, W] on CPU (a stacked tensor or a list of [3, H, W])."""
    images = torch.stack(list(images)) if not isinstance(images, torch.Tensor) else images
    if images.ndim == 5:
        raise ValueError(f"{reward} scores images, got videos {tuple(images.shape)}; use it with an image model")
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"{reward}: images must be uint8 [N, 3, H, W], got {images.dtype} {tuple(images.shape)}")
    return images.cpu()


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """uint8 [N, 3, H, W] as RGB PIL images (exact: no rescaling)."""
    return [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in images]


def normalised(features: torch.Tensor) -> torch.Tensor:
    return features / features.norm(p=2, dim=-1, keepdim=True)
