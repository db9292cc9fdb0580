"""The Qwen-Image edit pipelines' `Qwen2VLProcessor`, with or without torchvision.

transformers (5.x) makes a `Qwen2VLProcessor` only with a video processor, `Qwen2VLVideoProcessor`,
which imports torchvision, and a CPU build of torch often has no torchvision beside it. The edit
pipelines never give the processor a video: they call it with a prompt and its images. So where
torchvision is missing, `Qwen2VLImageTextProcessor` stands in: `Qwen2VLProcessor` itself (its
`__call__`, image processor and tokenizer) with no video processor. Where torchvision is
installed, the ordinary `Qwen2VLProcessor` is loaded, as diffusers would.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2VLProcessor
from transformers.utils import is_torchvision_available


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` for images and text only: the same tokens and pixel values for a prompt
    and its images, no video processor (so no torchvision)."""

    # ProcessorMixin reads a processor's parts from its __init__'s parameters: here the image
    # processor and the tokenizer, which are all it checks, saves and loads.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)

    def to_dict(self) -> dict:
        # A folder saved from it holds a Qwen2VLProcessor's files (less the video processor's), so
        # the ordinary class loads it where torchvision is installed.
        return {**super().to_dict(), "processor_class": Qwen2VLProcessor.__name__}


def load_qwen_vl_processor(folder: str | Path) -> Qwen2VLProcessor:
    """The processor saved in `folder` (a pipeline's `processor/`: its tokenizer and image
    processor config): a `Qwen2VLProcessor` where torchvision is installed, else a
    `Qwen2VLImageTextProcessor`."""
    processor_class = Qwen2VLProcessor if is_torchvision_available() else Qwen2VLImageTextProcessor
    return processor_class.from_pretrained(str(folder), local_files_only=True)
