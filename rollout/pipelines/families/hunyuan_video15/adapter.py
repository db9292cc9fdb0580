"""HunyuanVideo 1.5: text-to-video (`HunyuanVideo15Pipeline`) and image-to-video
(`HunyuanVideo15ImageToVideoPipeline`).

What the pipelines compute, and so the adapters:
- Text: two encoders, each padded to a fixed length with a mask: Qwen2.5-VL's third hidden state
  from the end of the prompt in the pipeline's chat template (its system message cut off: 1000
  tokens), and ByT5 over the prompt's quoted text (glyphs: 256 tokens, zeros and an empty mask when
  the prompt quotes nothing). The transformer moves each row's valid tokens first, so rows of any
  prompts batch together. There is no `max_sequence_length`.
- Latents [C, F', h, w] (C = 32, F' = (num_frames - 1) / 4 + 1; the VAE compresses space 16x).
  Every forward reads `torch.cat([latents, first-frame latents, mask], dim=1)` (2C + 1 channels)
  and SigLIP image tokens: for text-to-video the frame and mask are zeros and the image tokens
  zeros (which the transformer drops); the prediction is the noisy latents' velocity alone, so the
  trajectory is the noisy latents, the pipeline's `latents=`.
- Schedule: the flow-matching Euler scheduler's (shift 5 at 480p) over `linspace(1, 0, n + 1)[:-1]`,
  or the pipeline's `sigmas=`; the transformer reads the scheduler's timestep.
- Guidance: the pipeline takes no guidance argument; its `guider` component
  (`ClassifierFreeGuidance`, `guidance_scale` 6.0 in the published folders) guides against the
  negative prompt ("" unless one is named) in a second pass whenever its scale is not 1. A
  request's `guidance_scale` is that guider's scale (default: the folder's guider's); scales below
  1, which the guider would also guide with, are refused (`ModelSpec.min_guidance_scale`). A guider
  the engine does not reproduce (rescaled, the original formulation, a start or stop, disabled) is
  refused when the folder loads.

Image-to-video: the request's one input image (`images=`) is the first frame. The pipeline takes no
size: it makes the video at the bucket of about `target_size`^2 pixels (640^2 at 480p) nearest the
frame's aspect ratio (`HunyuanVideo15ImageProcessor.calculate_default_height_width`), crops the
frame to it, and reads its SigLIP tokens and its VAE latents (the mode, scaled) as the first latent
frame with a mask of ones there. So a request's size is that bucket (`ModelSpec.first_frame_sizes`;
any other is refused), and the frame is encoded once per (image, size). The step-distilled I2V
model (`use_meanflow`, which reads the next step's timestep too) is not run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from rollout.condition import PromptEmbeds
from rollout.input_images import InputImages
from rollout.model_spec import ModelSpec
from rollout.pipelines.adapter import PipelineAdapter, images_to_uint8

DEFAULT_ASPECT_RATIO = (16, 9)  # HunyuanVideo15Pipeline.default_aspect_ratio, (width, height)


@dataclass
class HunyuanVideo15Embeds(PromptEmbeds):
    """prompt_embeds: [1000, D] Qwen2.5-VL tokens and prompt_mask [1000] (True: the prompt's);
    glyph_embeds: [256, D2] ByT5 tokens of the quoted text and glyph_mask [256]: fixed lengths."""

    prompt_embeds: torch.Tensor
    prompt_mask: torch.Tensor
    glyph_embeds: torch.Tensor
    glyph_mask: torch.Tensor


@dataclass
class HunyuanVideo15FirstFrame(PromptEmbeds):
    """latents: [C, 1, h, w] the cropped first frame's scaled VAE latents (mode); image_embeds:
    [N, D] its SigLIP tokens (729 of 1152 for SigLIP at 384)."""

    latents: torch.Tensor
    image_embeds: torch.Tensor


class HunyuanVideo15Adapter(PipelineAdapter):
    pipeline_class = "HunyuanVideo15Pipeline"
    # The attention projections of the dual-stream blocks (and the text refiner's), as Wan's targets.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    cfg_in_one_pass = False  # the guider runs the unconditional batch on its own

    def __init__(self, pipeline):
        check_guider(pipeline.guider, self.pipeline_class)
        super().__init__(pipeline)

    @classmethod
    def pipeline_arguments(cls, pipeline, fields: dict) -> dict:
        # The pipeline has no guidance argument: its guider holds the scale.
        fields = dict(fields)
        if "guidance_scale" in fields:
            pipeline.guider = pipeline.guider.new(guidance_scale=fields.pop("guidance_scale"))
        return fields

    def make_spec(self) -> ModelSpec:
        pipeline = self.pipeline
        # HunyuanVideo15Pipeline.__call__: 16:9 at about target_size^2 pixels when no size is given
        # (image-to-video's size is its first frame's bucket, so this default is never used there).
        aspect_width, aspect_height = DEFAULT_ASPECT_RATIO
        height, width = pipeline.video_processor.calculate_default_height_width(
            aspect_height, aspect_width, pipeline.target_size
        )
        return ModelSpec(
            pipeline_class=self.pipeline_class,
            latent_channels=pipeline.num_channels_latents,
            vae_scale_factor=pipeline.vae_scale_factor_spatial,
            patch_size=self.transformer.config.patch_size,
            latent_packing=1,
            default_height=height,
            default_width=width,
            default_max_sequence_length=pipeline.tokenizer_max_length,
            max_sequence_length_limit=pipeline.tokenizer_max_length,
            takes_max_sequence_length=False,
            guidance_defaults={"guidance_scale": float(pipeline.guider.guidance_scale)},
            cfg_field="guidance_scale",
            min_guidance_scale=1.0,
            default_negative_prompt="",  # encode_prompt(prompt=None) encodes [""]
            default_num_frames=121,
            frame_multiple=pipeline.vae_scale_factor_temporal,
            temporal_patch_size=self.transformer.config.patch_size_t,
        )

    def encode_prompt(self, text: str, max_sequence_length: int) -> HunyuanVideo15Embeds:
        embeds, mask, glyphs, glyph_mask = self.pipeline.encode_prompt(
            prompt=[text], device=self.device, dtype=self.dtype, batch_size=1
        )
        return HunyuanVideo15Embeds(embeds[0], mask[0].bool(), glyphs[0], glyph_mask[0].bool())

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int, sigmas) -> None:
        # HunyuanVideo15Pipeline.__call__ step 4.
        if sigmas is None:
            sigmas = np.linspace(1.0, 0.0, num_steps + 1)[:-1]
        scheduler.set_timesteps(sigmas=list(sigmas), device="cpu")

    def run_transformer(self, latents, sigmas, embeds: HunyuanVideo15Embeds, guidance_scale, height, width, **inputs):
        # The denoising loop's `torch.cat([latents, cond_latents_concat, mask_concat], dim=1)` and
        # its timestep, `t` in the latents' dtype.
        frame, mask, image_embeds = self.first_frame_inputs(latents, **inputs)
        dtype = latents.dtype
        timestep = (sigmas * self._scheduler.config.num_train_timesteps).to(dtype)
        text, text_mask = unpadded(embeds.prompt_embeds, embeds.prompt_mask)
        glyphs, glyph_mask = unpadded(embeds.glyph_embeds, embeds.glyph_mask)
        if not image_embeds.any():  # text-to-video's zero image tokens, every one masked out
            image_embeds = image_embeds[:, :0]
        return self.transformer(
            hidden_states=torch.cat([latents, frame, mask], dim=1),
            image_embeds=image_embeds,
            timestep=timestep,
            encoder_hidden_states=text,
            encoder_attention_mask=text_mask.to(dtype),
            encoder_hidden_states_2=glyphs,
            encoder_attention_mask_2=glyph_mask.to(dtype),
            return_dict=False,
        )[0]

    def first_frame_inputs(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(first-frame latents [B, C, F', h, w], mask [B, 1, F', h, w], image tokens [B, N, D]):
        text-to-video's zeros (`prepare_cond_latents_and_mask`, and 729 zero SigLIP tokens)."""
        batch, _, frames, h, w = latents.shape
        pipeline = self.pipeline
        mask = latents.new_zeros((batch, 1, frames, h, w))
        image_embeds = latents.new_zeros((batch, pipeline.vision_num_semantic_tokens, pipeline.vision_states_dim))
        return torch.zeros_like(latents), mask, image_embeds

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        # One video at a time: the VAE's attention builds its causal mask [B, S, S] against queries
        # [B, 1, S, C], which broadcasts only for B = 1 (the pipeline decodes one prompt's video).
        vae = self.pipeline.vae
        scaled = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor
        video = torch.cat([vae.decode(row[None], return_dict=False)[0] for row in scaled])
        return images_to_uint8(video.transpose(1, 2))  # [B, 3, F, H, W] -> [B, F, 3, H, W]


class HunyuanVideo15ImageToVideoAdapter(HunyuanVideo15Adapter):
    pipeline_class = "HunyuanVideo15ImageToVideoPipeline"

    def __init__(self, pipeline):
        if pipeline.transformer.config.use_meanflow:
            raise ValueError(
                "HunyuanVideo15ImageToVideoPipeline with use_meanflow (the step-distilled 480p I2V model) is not "
                "supported: its transformer reads the next step's timestep too; run a model without use_meanflow"
            )
        super().__init__(pipeline)

    @classmethod
    def pipeline_arguments(cls, pipeline, fields: dict) -> dict:
        # No size either: the pipeline makes the first frame's bucket (the engine's requests ask for it).
        fields = super().pipeline_arguments(pipeline, fields)
        return {name: value for name, value in fields.items() if name not in ("height", "width")}

    def make_spec(self) -> ModelSpec:
        from diffusers.pipelines.hunyuan_video1_5.image_processor import generate_crop_size_list

        pipeline = self.pipeline
        buckets = generate_crop_size_list(base_size=pipeline.target_size, patch_size=pipeline.vae_scale_factor_spatial)
        return dataclasses.replace(
            super().make_spec(),
            min_input_images=1,
            max_input_images=1,
            first_frame=True,
            first_frame_sizes=tuple(buckets),
        )

    @torch.no_grad()
    def encode_images(self, images: InputImages) -> HunyuanVideo15FirstFrame:
        # HunyuanVideo15ImageToVideoPipeline.__call__: the crop to the video's size (admission held
        # the request's size to the pipeline's bucket), encode_image, and prepare_cond_latents_and_mask's
        # image latents.
        pipeline = self.pipeline
        (image,) = images.pil()
        height, width = images.setting("height", None), images.setting("width", None)
        image = pipeline.video_processor.resize(image, height=height, width=width, resize_mode="crop")
        image_embeds = pipeline.encode_image(image=image, batch_size=1, device=self.device, dtype=self.dtype)
        latents = pipeline._get_image_latents(
            vae=pipeline.vae,
            image_processor=pipeline.video_processor,
            image=image,
            height=height,
            width=width,
            device=self.device,
        )
        return HunyuanVideo15FirstFrame(latents[0], image_embeds[0]).to(self.device, self.dtype)

    def run_transformer(
        self, latents, sigmas, embeds, guidance_scale, height, width, images: HunyuanVideo15FirstFrame | None = None
    ) -> torch.Tensor:
        if images is None:  # refused at admission (min_input_images); a trainer's condition has one
            raise ValueError("HunyuanVideo15ImageToVideoPipeline needs each sample's first frame (condition.images)")
        return super().run_transformer(latents, sigmas, embeds, guidance_scale, height, width, images=images)

    def first_frame_inputs(self, latents, images: HunyuanVideo15FirstFrame):
        # prepare_cond_latents_and_mask: the frame's latents as the first latent frame (zeros after
        # it), a mask of ones there; the frame's SigLIP tokens.
        frame = torch.zeros_like(latents)
        frame[:, :, :1] = images.latents.to(latents.dtype)
        mask = torch.zeros_like(latents[:, :1])
        mask[:, :, 0] = 1.0
        return frame, mask, images.image_embeds.to(latents.dtype)


def unpadded(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens` [B, L, D] and `mask` [B, L] without the positions no row uses. The pipeline pads its
    text to fixed lengths (1000 + 256 tokens, and 729 zero image tokens for text-to-video), but the
    transformer masks padded tokens out of every attention, carries no positions on text tokens
    (its rotary embedding is the video's), and pools the text over its mask: dropping a position
    masked in every row changes no valid token's value, and spares attending over ~2000 tokens
    when a prompt has ~100 (on the tiny model, 4x the video's tokens)."""
    keep = mask.any(dim=0)
    if bool(keep.all()):
        return tokens, mask
    return tokens[:, keep], mask[:, keep]


def check_guider(guider, model: str) -> None:
    """Refuse a guider whose computation the engine does not reproduce: it runs
    `uncond + scale * (cond - uncond)` on every step, against the negative prompt."""
    config = guider.config
    problems = []
    if not guider._enabled:
        problems.append("it is disabled")
    if config.guidance_rescale:
        problems.append(f"guidance_rescale={config.guidance_rescale}")
    if config.use_original_formulation:
        problems.append("use_original_formulation")
    if not math.isclose(config.start, 0.0) or not math.isclose(config.stop, 1.0):
        problems.append(f"start={config.start}, stop={config.stop} (guidance on some steps only)")
    if type(guider).__name__ != "ClassifierFreeGuidance":
        problems = [f"it is a {type(guider).__name__}"]
    if problems:
        raise ValueError(
            f"{model}'s guider is not supported: {'; '.join(problems)}. The engine guides as a plain "
            "ClassifierFreeGuidance (guidance_scale from the request, enabled, no rescale, every step); "
            "save the folder with such a guider"
        )
