"""Qwen-Image-Edit (`QwenImageEditPipeline`) and Qwen-Image-Edit-Plus (`QwenImageEditPlusPipeline`,
several reference images): Qwen-Image that edits input images.

The transformer is Qwen-Image's. Each reference image's VAE latents, packed like the noisy latents,
are concatenated after the noisy tokens in every forward pass, `img_shapes` lists the output's
token grid then each reference image's, and the velocity is the prediction's first (noisy) tokens.
The prompt is encoded by Qwen2.5-VL together with the images (their vision tokens, through the
pipeline's `Qwen2VLProcessor`, in the edit pipelines' own template and drop index), so a prompt's
embeddings depend on its images: the runner keys them by (text, images digest)
(`ModelSpec.prompt_reads_images`). The negative prompt of true CFG is encoded with the same images,
and the unconditional pass sees the same reference latents; the guided prediction is rescaled to
the conditional one's norm, as in Qwen-Image.

Sizes, as the pipelines compute them (`calculate_dimensions`): Edit resizes its image to about a
megapixel at the image's aspect ratio, for both the VAE and the vision encoder. Plus resizes each
image twice: to about 384 x 384 pixels for the vision encoder (`CONDITION_IMAGE_SIZE`) and to a
megapixel for the VAE (`VAE_IMAGE_SIZE`). An edit that sets no size is made at a megapixel with the
aspect ratio of the (Edit) image or (Plus) last image, as the pipelines' defaults. Both pipelines
require an image, so these families take no text-only request. The pipelines accept
`max_sequence_length` (at most 1024) but never truncate the prompt's tokens to it, and neither does
the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from rollout.condition import PromptEmbeds
from rollout.input_images import InputImages
from rollout.model_spec import ModelSpec, area_size
from rollout.pipelines.families.qwen_image.adapter import QwenImageAdapter, QwenImageEmbeds

# QwenImageEditPipeline.__call__'s target area (written inline there) for the resized input image.
EDIT_IMAGE_AREA = 1024 * 1024
# Qwen-Image-Edit-2509's model card: multi-image editing works best with 1 to 3 input images.
PLUS_MAX_INPUT_IMAGES = 3


@dataclass
class QwenEditImages(PromptEmbeds):
    """latents: [N, C*4] the reference images' packed VAE latents (normalised by the VAE's latent
    mean and std, as the pipeline does), one image after another; grids: [K, 3] int64, each
    image's (frames, rows, columns) token grid, as `img_shapes` lists it after the output's."""

    latents: torch.Tensor
    grids: torch.Tensor


class QwenImageEditAdapter(QwenImageAdapter):
    pipeline_class = "QwenImageEditPipeline"
    max_input_images: ClassVar[int] = 1
    edit_size_image: ClassVar[int] = 0  # QwenImageEditPipeline.__call__: `image[0].size` of a list

    @classmethod
    def given_components(cls, path: Path) -> dict[str, Any]:
        # The pipelines' processor, made without torchvision where it is missing (qwen_vl_processor.py;
        # diffusers' own loader would need torchvision). Imported here: the registry imports this file.
        from rollout.pipelines.qwen_vl_processor import load_qwen_vl_processor

        return {"processor": load_qwen_vl_processor(path / "processor")}

    def make_spec(self) -> ModelSpec:
        return dataclasses.replace(
            super().make_spec(),
            min_input_images=1,  # the pipeline reads `image.size` before anything else
            max_input_images=self.max_input_images,
            edit_area=EDIT_IMAGE_AREA,
            edit_size_image=self.edit_size_image,
            encoded_image_area=EDIT_IMAGE_AREA,  # Edit resizes for the VAE as for the output size
            prompt_reads_images=True,
        )

    def vae_sizes(self, images: InputImages) -> list[tuple[int, int]]:
        """(height, width) each image is resized to before the VAE encodes it: the spec's arithmetic
        (`encoded_image_sizes`), which the scheduler batches by. (Edit's vision encoder reads the
        same resized image, so its vision tokens follow from this size too; Plus's read a smaller
        resize, which only sets the prompt's length, and prompts of any length pad to one batch.)"""
        return list(self.spec.encoded_image_sizes(images.sizes))

    def vision_images(self, images: InputImages) -> list:
        """The PIL images the vision encoder reads with the prompt (Edit: the resized VAE image)."""
        image_processor = self.pipeline.image_processor
        return [
            image_processor.resize(image, height, width)
            for image, (height, width) in zip(images.pil(), self.vae_sizes(images), strict=True)
        ]

    def encode_prompt(self, text: str, max_sequence_length: int) -> QwenImageEmbeds:
        raise ValueError(
            f"{self.pipeline_class} encodes a prompt together with its input images; "
            "pass images=[[image], ...] with every prompt"
        )

    def encode_prompt_with_images(self, text: str, max_sequence_length: int, images: InputImages) -> QwenImageEmbeds:
        # QwenImageEditPipeline.__call__ step 3 (`prompt_image`) and encode_prompt; Plus passes its list.
        (image,) = self.vision_images(images)
        embeds, mask = self.pipeline.encode_prompt(prompt=[text], image=image, device=self.device)
        return _unbatched(embeds, mask).to(self.device, self.dtype)

    def encode_images(self, images: InputImages) -> QwenEditImages:
        # __call__ step 3 and prepare_latents: each image preprocessed at its VAE size, encoded with
        # the VAE's mode (no noise drawn), normalised, packed; Plus concatenates them in order.
        pipeline = self.pipeline
        packed, grids = [], []
        for image, (height, width) in zip(images.pil(), self.vae_sizes(images), strict=True):
            image = self.vae_input(image, height, width)
            pixels = pipeline.image_processor.preprocess(image, height, width).unsqueeze(2)
            latents = pipeline._encode_vae_image(pixels.to(self.device, self.dtype), generator=None)
            _, channels, _, latent_height, latent_width = latents.shape
            packed.append(pipeline._pack_latents(latents, 1, channels, latent_height, latent_width)[0])
            grids.append((1, latent_height // 2, latent_width // 2))
        return QwenEditImages(torch.cat(packed), torch.tensor(grids)).to(self.device, self.dtype)

    def vae_input(self, image, height: int, width: int):
        """The image `preprocess` takes (Edit resizes it first, then preprocesses the resized one)."""
        return self.pipeline.image_processor.resize(image, height, width)

    def run_transformer(
        self, latents, sigmas, embeds: QwenImageEmbeds, guidance_scale, height, width, images: QwenEditImages
    ) -> torch.Tensor:
        hidden_states = torch.cat([latents, images.latents], dim=1)
        # The rows of a batch hold images of one size (the batch key), so their grids agree.
        grids = [tuple(grid) for grid in images.grids[0].tolist()]
        img_shapes = [self.output_tokens(height, width), *grids]
        return self._forward(hidden_states, sigmas, embeds, guidance_scale, img_shapes)[:, : latents.shape[1]]


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    pipeline_class = "QwenImageEditPlusPipeline"
    max_input_images = PLUS_MAX_INPUT_IMAGES
    edit_size_image = -1  # QwenImageEditPlusPipeline.__call__: `image[-1].size`

    def make_spec(self) -> ModelSpec:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE

        return dataclasses.replace(super().make_spec(), encoded_image_area=VAE_IMAGE_SIZE)

    def vision_images(self, images: InputImages) -> list:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE

        image_processor = self.pipeline.image_processor
        return [
            image_processor.resize(image, *area_size(CONDITION_IMAGE_SIZE, image.height, image.width))
            for image in images.pil()
        ]

    def encode_prompt_with_images(self, text: str, max_sequence_length: int, images: InputImages) -> QwenImageEmbeds:
        # QwenImageEditPlusPipeline.__call__ step 3 (`condition_images`) and encode_prompt.
        embeds, mask = self.pipeline.encode_prompt(prompt=[text], image=self.vision_images(images), device=self.device)
        return _unbatched(embeds, mask).to(self.device, self.dtype)

    def vae_input(self, image, height: int, width: int):
        return image  # Plus preprocesses the input image itself at the VAE size


def _unbatched(embeds: torch.Tensor, mask: torch.Tensor | None) -> QwenImageEmbeds:
    """The pipeline's one-prompt `encode_prompt` result (mask None when nothing is padded)."""
    mask = torch.ones(embeds.shape[1], dtype=torch.bool, device=embeds.device) if mask is None else mask[0].bool()
    return QwenImageEmbeds(embeds[0], mask)
