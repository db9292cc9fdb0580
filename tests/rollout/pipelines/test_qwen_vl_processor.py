"""The Qwen-Image edit pipelines' processor without torchvision: `Qwen2VLImageTextProcessor` saves a
folder that names `Qwen2VLProcessor` and loads back from it, and it expands a prompt's image marker
into the image's vision tokens as `Qwen2VLProcessor` does (the pipelines' drop index counts them)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2VLProcessor
from transformers.utils import is_torchvision_available

from rollout.input_images import InputImages
from rollout.pipelines.families.qwen_image_edit.tiny import VISION_MERGE, tiny_processor
from rollout.pipelines.qwen_vl_processor import Qwen2VLImageTextProcessor, load_qwen_vl_processor
from tests.families import input_image

pytestmark = pytest.mark.timeout(60)

PROMPT = "<|vision_start|><|image_pad|><|vision_end|>make it red"


def test_a_saved_processor_loads_back_and_reads_an_image_with_its_prompt(tmp_path):
    processor = tiny_processor()
    processor.save_pretrained(tmp_path)
    processor.image_processor.save_pretrained(tmp_path)  # as the tiny builders save it
    assert json.loads((tmp_path / "processor_config.json").read_text())["processor_class"] == "Qwen2VLProcessor"

    loaded = load_qwen_vl_processor(tmp_path)
    assert type(loaded) is (Qwen2VLProcessor if is_torchvision_available() else Qwen2VLImageTextProcessor)
    (image,) = InputImages.of([input_image(0, 60, 90)]).pil()
    made, read = (p(text=[PROMPT], images=[image], padding=True, return_tensors="pt") for p in (processor, loaded))
    for key in ("input_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(made[key], read[key]), key
    (grid,) = read["image_grid_thw"]
    image_tokens = (read["input_ids"][0] == loaded.image_token_id).sum().item()
    assert image_tokens == grid.prod().item() // VISION_MERGE**2 > 1  # one marker became the image's tokens
