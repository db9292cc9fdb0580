"""Tiny CLIP scorers of the real transformers classes, with random weights: what the tests and the
tiny recipes score with, since nothing is downloaded.

`build_tiny_clip(folder)` saves a `CLIPModel` and its `CLIPProcessor` (the tiny pipelines' byte-level
CLIP tokenizer, a CLIP image processor with OpenAI's mean and std) the way a hub folder holds them,
so the reward classes load them with the same `from_pretrained` code as PickScore or CLIP ViT-L/14.
`build_tiny_aesthetic_head(path, embed_dim)` writes a random LAION-style head as safetensors.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rollout.pipelines.tiny.tokenizers import clip_tokenizer

logger = logging.getLogger(__name__)

# OpenAI CLIP's pixel statistics, as every CLIP processor on the hub (ViT-L/14, CLIP-H) carries them.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def build_tiny_clip(folder: str | Path, *, image_size: int = 32, hidden_size: int = 32, seed: int = 0) -> Path:
    """Save a random `CLIPModel` (2 layers per tower, patch 8) and its `CLIPProcessor` to `folder`."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    tokenizer = clip_tokenizer()
    text = dict(
        vocab_size=len(tokenizer.get_vocab()),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=8,
    )
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=hidden_size))
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    )
    folder = Path(folder)
    model.save_pretrained(folder)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    logger.info("saved a tiny CLIPModel and CLIPProcessor (random weights) to %s", folder)
    return folder


def build_tiny_aesthetic_head(path: str | Path, *, embed_dim: int = 32, seed: int = 0) -> Path:
    """Write a random LAION v2 aesthetic head over `embed_dim` features (the tiny CLIP's projection
    width) to `path` as safetensors, with the published key names."""
    from trainers_adapters.rewards.models.aesthetic import aesthetic_head, save_aesthetic_head

    torch.manual_seed(seed)
    return save_aesthetic_head(aesthetic_head(embed_dim), path)
