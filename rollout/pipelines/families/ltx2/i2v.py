"""LTX-2 image-to-video with audio (`LTX2ImageToVideoPipeline`): LTX-2 text-to-video, given its first frame.

The request's one input image (`images=`) is the video's first frame, as the pipeline's `image=`.
The pipeline resizes it to the video's size, encodes it with the video VAE's mode, normalises it,
and puts its packed tokens in the first latent frame; every forward gives those tokens timestep 0
(`timestep * (1 - conditioning_mask)`, the audio keeps the step's timestep) and the scheduler steps
only the latent frames after it. Here the first frame is conditioning, not state: a sample's
latent vector is the packed video tokens of latent frames 1.. then the audio
(`ModelSpec.given_latent_frames` = 1), `run_transformer` puts the frame's tokens before them at
timestep 0 and drops their velocity, and `decode` puts them back. So every sampler steps exactly
what the pipeline steps, and no noise or log-density touches the given frame (docs/ltx2_design.md).

The pipeline's default re-compresses the image through H.264 before it encodes it (`image_crf`, 33
for LTX-2's Gemma 3 generation; PyAV). The engine encodes the image as it is given, the pipeline's
`image_crf=0`: a caller who wants the compression the model was trained with applies
`diffusers.pipelines.ltx2.utils.apply_image_conditioning_crf` to the image before sending it, which
is what the pipeline does with it. The first frame is encoded once per (image, size, frame count)
and shared by every sample that sends them, as Wan image-to-video's; a request without one is
refused, and one that sets no size is made at the pipeline's default 512x768.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rollout.condition import PromptEmbeds
from rollout.input_images import InputImages
from rollout.model_spec import ModelSpec
from rollout.pipelines.families.ltx2.adapter import PIPELINE_GUIDANCE_OFF, LTX2Adapter, LTX2Embeds

# LTX2ImageToVideoPipeline's arguments that make it compute what the engine does: text-to-video's,
# and the first frame encoded as given (no H.264 re-compression; see the module's docstring).
PIPELINE_SETTINGS = {**PIPELINE_GUIDANCE_OFF, "image_crf": 0}


@dataclass
class LTX2FirstFrame(PromptEmbeds):
    """tokens: [h * w, C] the first frame's packed, normalised VAE latents (the pipeline's first
    latent frame), at the video's size."""

    tokens: torch.Tensor


class LTX2ImageToVideoAdapter(LTX2Adapter):
    pipeline_class = "LTX2ImageToVideoPipeline"
    decode_reads_images = True

    def __init__(self, pipeline):
        config = pipeline.transformer.config
        if (config.patch_size, config.patch_size_t) != (1, 1):
            # The pipeline's conditioning mask is one value per token (`_pack_latents(mask).squeeze(-1)`).
            raise ValueError(
                f"LTX2ImageToVideoPipeline takes a transformer of patch size 1 in space and time, got "
                f"patch_size={config.patch_size}, patch_size_t={config.patch_size_t}"
            )
        super().__init__(pipeline)

    def make_spec(self) -> ModelSpec:
        # LTX2ImageToVideoPipeline's defaults are LTX2Pipeline's (512x768, 121 frames, guidance 3).
        return dataclasses.replace(
            super().make_spec(), min_input_images=1, max_input_images=1, first_frame=True, given_latent_frames=1
        )

    @torch.no_grad()
    def encode_images(self, images: InputImages) -> LTX2FirstFrame:
        # LTX2ImageToVideoPipeline.__call__ step 4 (image_crf=0) and prepare_latents: the frame
        # resized to the video's size, the VAE's mode ("argmax"), normalised (scaling factor 1, as
        # there), packed.
        pipeline, vae = self.pipeline, self.pipeline.vae
        (image,) = images.pil()
        height, width = images.setting("height", None), images.setting("width", None)
        pixels = pipeline.video_processor.preprocess(image, height=height, width=width)
        latents = vae.encode(pixels.to(self.device, self.dtype).unsqueeze(2)).latent_dist.mode()
        latents = pipeline._normalize_latents(latents.float(), vae.latents_mean, vae.latents_std)
        tokens = pipeline._pack_latents(latents, 1, 1)[0]
        return LTX2FirstFrame(tokens).to(self.device, self.dtype)

    def run_transformer(
        self, latents, sigmas, embeds: LTX2Embeds, guidance_scale, height, width, images: LTX2FirstFrame | None = None
    ) -> torch.Tensor:
        if images is None:  # refused at admission (min_input_images); a trainer's condition has one
            raise ValueError("LTX2ImageToVideoPipeline needs each sample's first frame (condition.images)")
        layout = self.layout(latents, height, width)
        made, audio = layout.split(latents)
        batch, given = len(latents), layout.given_tokens
        timestep = sigmas * self._scheduler.config.num_train_timesteps
        # The pipeline's `timestep * (1 - conditioning_mask)`: 0 for the first frame's tokens.
        video_timestep = torch.cat(
            [timestep.new_zeros(batch, given), timestep[:, None].expand(batch, layout.state_tokens)], dim=1
        )
        video = torch.cat([images.tokens.to(made.dtype), made], dim=1)
        video_velocity, audio_velocity = self.velocities(video, audio, layout, embeds, timestep, video_timestep)
        return torch.cat([video_velocity[:, given:].reshape(batch, -1), audio_velocity.reshape(batch, -1)], dim=1)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int, images: LTX2FirstFrame) -> torch.Tensor:
        layout = self.layout(latents, height, width)
        made, _ = layout.split(latents)
        return self.decode_video(torch.cat([images.tokens.to(made.dtype), made], dim=1), layout)
