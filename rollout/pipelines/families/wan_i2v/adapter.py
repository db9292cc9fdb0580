"""Wan 2.1 and Wan 2.2 image-to-video (`WanImageToVideoPipeline`): Wan text-to-video, given its first frame.

The request's one input image (`images=`) is the video's first frame, as the pipeline's `image=`.
The pipeline resizes it to the video's size, puts it before `num_frames - 1` black frames, encodes
that video with the VAE's mode and normalises it; a mask marks the first latent frame's
`vae_scale_factor_temporal` frames as given (1) and the rest as to be made (0). Mask and latents
([s + C, F', h, w]) go after the noisy latents' channels in every forward (the transformer's
`in_channels` is 2C + s: 36 for Wan), and its prediction is the noisy latents' velocity alone, so
the trajectory is the noisy latents ([C, F', h, w]), as the pipeline takes them as `latents=`.

Wan 2.1 I2V (a transformer with `image_dim`) also reads the frame's CLIP image embeddings (the
image encoder's penultimate hidden states, [257, 1280] for CLIP ViT-H at 224) through added
key/value projections of its cross-attention. Wan 2.2 I2V A14B has no image encoder; its two experts
split the steps at `boundary_ratio` (0.9) as `WanAdapter` splits Wan 2.2 T2V's.

The first frame's encoding depends on the video's size and frame count, so it is encoded once per
(image, height, width, num_frames) (`ModelSpec.image_encoding`) and shared by every sample that
sends them; the unconditional pass of CFG sees the same frame, as in the pipeline. A request without
a first frame is refused (the pipeline requires `image`), and one that sets no size is made at the
pipeline's default 480x832, not at the image's size. Wan 2.2 TI2V-5B's image-to-video mode
(`expand_timesteps`: the first frame blended into the latents, a timestep per token) is not run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rollout.condition import PromptEmbeds
from rollout.input_images import InputImages
from rollout.model_spec import ModelSpec
from rollout.pipelines.families.wan.adapter import WanAdapter, WanEmbeds


@dataclass
class WanFirstFrame(PromptEmbeds):
    """condition: [s + C, F', h, w] the mask (s = the VAE's temporal scale) and the normalised VAE
    latents of the first frame followed by black frames, as `prepare_latents` returns them;
    image_embeds: [N, D] the frame's CLIP hidden states (Wan 2.1), or [0] where the transformer
    reads none (Wan 2.2)."""

    condition: torch.Tensor
    image_embeds: torch.Tensor


class WanImageToVideoAdapter(WanAdapter):
    pipeline_class = "WanImageToVideoPipeline"

    def __init__(self, pipeline):
        if pipeline.config.expand_timesteps:
            raise ValueError(
                "WanImageToVideoPipeline with expand_timesteps (Wan 2.2 TI2V-5B's image-to-video) is not "
                "supported: its first frame is blended into the latents; run TI2V-5B as WanPipeline (text-to-video)"
            )
        super().__init__(pipeline)

    def make_spec(self) -> ModelSpec:
        # WanImageToVideoPipeline's defaults are WanPipeline's (480x832, 81 frames, guidance 5).
        return dataclasses.replace(
            super().make_spec(),
            latent_channels=self.pipeline.vae.config.z_dim,  # the transformer's in_channels add the frame's
            min_input_images=1,
            max_input_images=1,
            first_frame=True,
        )

    def encode_prompt(self, text: str, max_sequence_length: int) -> WanEmbeds:
        # WanImageToVideoPipeline's text encoding is WanPipeline's ("Copied from"), but its
        # `basic_clean` calls ftfy unconditionally, a NameError where ftfy is not installed;
        # WanPipeline's runs ftfy where it is installed, so this is the same text encoding either way.
        from diffusers import WanPipeline

        embeds = WanPipeline._get_t5_prompt_embeds(
            self.pipeline, prompt=[text], max_sequence_length=max_sequence_length, device=self.device
        )
        return WanEmbeds(embeds[0]).to(self.device, self.dtype)

    @torch.no_grad()
    def encode_images(self, images: InputImages) -> WanFirstFrame:
        # WanImageToVideoPipeline.__call__: encode_image (Wan 2.1), then step 5's preprocess and
        # prepare_latents at the request's size and frame count (`ModelSpec.image_encoding`).
        pipeline = self.pipeline
        (image,) = images.pil()
        height, width, num_frames = (images.setting(name, None) for name in ("height", "width", "num_frames"))
        if self.transformer.config.image_dim is not None:
            image_embeds = pipeline.encode_image(image, self.device)[0]
        else:
            image_embeds = torch.zeros(0)
        pixels = pipeline.video_processor.preprocess(image, height=height, width=width)
        channels = pipeline.vae.config.z_dim
        # Given latents, so prepare_latents draws no noise; only its condition is kept.
        noise = torch.zeros(1, channels, (num_frames - 1) // pipeline.vae_scale_factor_temporal + 1, 1, 1)
        _, condition = pipeline.prepare_latents(
            pixels.to(self.device, torch.float32),
            1,
            channels,
            height,
            width,
            num_frames,
            torch.float32,
            self.device,
            latents=noise,
        )
        return WanFirstFrame(condition[0], image_embeds).to(self.device, self.dtype)

    def run_transformer(
        self,
        latents,
        sigmas,
        embeds,
        guidance_scale,
        height,
        width,
        sigma_values=None,
        images: WanFirstFrame | None = None,
    ) -> torch.Tensor:
        if images is None:  # refused at admission (min_input_images); a trainer's condition has one
            raise ValueError("WanImageToVideoPipeline needs each sample's first frame (condition.images)")
        return super().run_transformer(
            latents, sigmas, embeds, guidance_scale, height, width, sigma_values=sigma_values, images=images
        )

    def expert_inputs(self, latents, rows, images: WanFirstFrame) -> dict[str, torch.Tensor]:
        # The pipeline's `torch.cat([latents, condition], dim=1)`, and Wan 2.1's image embeddings.
        inputs = {"hidden_states": torch.cat([latents[rows], images.condition[rows]], dim=1)}
        if self.transformer.config.image_dim is not None:
            inputs["encoder_hidden_states_image"] = images.image_embeds[rows]
        return inputs
