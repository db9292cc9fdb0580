"""The Qwen-Image pipelines' processors (`Qwen2VLProcessor`, and Qwen-Image 2.1's
`Qwen3VLProcessor`), with or without torchvision.

transformers (5.x) makes either processor only with a video processor, which imports torchvision,
and a CPU build of torch often has no torchvision beside it. The pipelines never give the
processor a video: they call it with a prompt and its images. So where torchvision is missing, an
image-and-text subclass stands in: the processor itself (its `__call__`, image processor and
tokenizer) with no video processor. Where torchvision is installed, the ordinary class is loaded,
as diffusers would.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2VLProcessor, Qwen3VLProcessor
from transformers.utils import is_torchvision_available


class _ImageTextOnly:
    """A Qwen VL processor for images and text only: the same tokens and pixel values for a prompt
    and its images, no video processor (so no torchvision)."""

    # ProcessorMixin reads a processor's parts from its __init__'s parameters: here the image
    # processor and the tokenizer, which are all it checks, saves and loads.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)

    def to_dict(self) -> dict:
        # A folder saved from it holds the full processor's files (less the video processor's), so
        # the ordinary class loads it where torchvision is installed.
        return {**super().to_dict(), "processor_class": type(self).__mro__[2].__name__}


class Qwen2VLImageTextProcessor(_ImageTextOnly, Qwen2VLProcessor):
    """`Qwen2VLProcessor` (the Qwen-Image edit pipelines') for images and text only."""


class Qwen3VLImageTextProcessor(_ImageTextOnly, Qwen3VLProcessor):
    """`Qwen3VLProcessor` (Qwen-Image 2.1's) for images and text only."""


def load_qwen_vl_processor(folder: str | Path, version: int = 2) -> Qwen2VLProcessor | Qwen3VLProcessor:
    """The processor saved in `folder` (a pipeline's `processor/`: its tokenizer and image
    processor config): a `Qwen2VLProcessor` (`version` 3: a `Qwen3VLProcessor`) where torchvision
    is installed, else its image-and-text subclass."""
    classes = {2: (Qwen2VLProcessor, Qwen2VLImageTextProcessor), 3: (Qwen3VLProcessor, Qwen3VLImageTextProcessor)}
    full, image_text = classes[version]
    processor_class = full if is_torchvision_available() else image_text
    return processor_class.from_pretrained(str(folder), local_files_only=True)
