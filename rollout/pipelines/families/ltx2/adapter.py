"""LTX-2 text-to-video with audio (`LTX2Pipeline`): one transformer denoises a video and its sound.

A sample's latents are one flat float32 vector, the video's packed tokens [S_v, D_v] then the
audio's packed frames [L_a, D_a] (in the transformer's space: normalised by the audio VAE's latent
statistics), so every sampler, the step history and re-scoring treat them as one state; this
adapter splits the vector before the transformer and joins the two velocities after it. Both parts
follow one schedule (the pipeline's audio scheduler is a copy of its video scheduler, set with the
same sigmas and shift), and the samplers' updates are elementwise, so this is exact; a
transition's log-prob averages over the elements of both (docs/ltx2_design.md).

Conditioning: Gemma 3's stacked hidden states through the pipeline's text connectors, one output
for the video stream and one for the audio stream, with their mask. `guidance_scale` is
classifier-free guidance of both modalities (> 1 with the negative prompt "" unless one is named),
in one pass with the conditional rows, as the pipeline runs it; the pipeline's STG, modality
isolation and guidance rescale are not run (its `stg_scale=0, modality_scale=1,
guidance_rescale=0`). The frame rate is the pipeline's default, 24.

The schedule's shift depends on the video's token count, so on the frame count as well as the
size (`schedule_reads_frames`). Outputs carry the frames (`video`) and the vocoder's waveform
(`audio`, [channels, samples] at `ModelSpec.audio_sample_rate`). Image-to-video, whose vector
leaves out the given first frame: ltx2_i2v.py.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from rollout.condition import PromptEmbeds
from rollout.model_spec import ModelSpec
from rollout.pipelines.adapter import PipelineAdapter, images_to_uint8

FRAME_RATE = 24.0  # LTX2Pipeline's default frame_rate (motion_speed 1)
# LTX2Pipeline's arguments that make it compute what the engine does: its other guidance terms off
# (STG, modality isolation, rescale) and the audio guided by guidance_scale (None falls back to it).
PIPELINE_GUIDANCE_OFF = {
    "stg_scale": 0.0,
    "modality_scale": 1.0,
    "guidance_rescale": 0.0,
    "audio_guidance_scale": None,
    "audio_stg_scale": None,
    "audio_modality_scale": None,
    "audio_guidance_rescale": None,
}


@dataclass
class LTX2Embeds(PromptEmbeds):
    """The text connectors' outputs for one prompt (padded to max_sequence_length, as the pipeline
    pads its tokens): prompt_embeds [L, D] for the video stream, audio_prompt_embeds [L, D_audio]
    for the audio stream, attention_mask [L]."""

    prompt_embeds: torch.Tensor
    audio_prompt_embeds: torch.Tensor
    attention_mask: torch.Tensor


@dataclass(frozen=True)
class JointLayout:
    """Where the video and the audio sit in one sample's latent vector. `video_tokens` counts the
    whole video's tokens, as the transformer sees them; the vector leaves out the first
    `given_tokens` of them (image-to-video's first frame, which the condition holds)."""

    latent_frames: int
    latent_height: int
    latent_width: int
    video_tokens: int
    video_features: int
    audio_frames: int
    audio_features: int
    given_tokens: int = 0

    @property
    def state_tokens(self) -> int:
        """The video tokens in the vector."""
        return self.video_tokens - self.given_tokens

    @property
    def video_size(self) -> int:
        return self.state_tokens * self.video_features

    def split(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, N] -> video tokens [B, S_v - given, D_v] and audio frames [B, L_a, D_a] (views)."""
        batch = latents.shape[0]
        video = latents[:, : self.video_size].reshape(batch, self.state_tokens, self.video_features)
        audio = latents[:, self.video_size :].reshape(batch, self.audio_frames, self.audio_features)
        return video, audio


class LTX2Adapter(PipelineAdapter):
    pipeline_class = "LTX2Pipeline"
    # The attention projections of the video, audio and cross-modal attentions of every block.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    cfg_in_one_pass = True  # LTX2Pipeline concatenates the negative and the positive rows
    schedule_reads_frames = True

    def __init__(self, pipeline):
        self._layouts: dict[tuple[int, int, int], JointLayout] = {}
        super().__init__(pipeline)

    def make_spec(self) -> ModelSpec:
        pipeline, config = self.pipeline, self.transformer.config
        patch, patch_t = config.patch_size, config.patch_size_t
        return ModelSpec(
            pipeline_class=self.pipeline_class,
            latent_channels=config.in_channels // (patch * patch * patch_t),
            vae_scale_factor=pipeline.vae_spatial_compression_ratio,
            patch_size=patch,
            latent_packing=1,
            # LTX2Pipeline's defaults: 512x768, 121 frames (no duration head), 1024 text tokens, guidance 3.
            default_height=512,
            default_width=768,
            default_max_sequence_length=1024,
            max_sequence_length_limit=1024,
            guidance_defaults={"guidance_scale": 3.0},
            cfg_field="guidance_scale",
            default_negative_prompt="",
            default_num_frames=121,
            frame_multiple=pipeline.vae_temporal_compression_ratio,
            temporal_patch_size=patch_t,
            pipeline_size_multiple=32,  # LTX2Pipeline.check_inputs
            audio_features=config.audio_in_channels,
            audio_latents_per_second=(
                pipeline.audio_sampling_rate
                / pipeline.audio_hop_length
                / float(pipeline.audio_vae_temporal_compression_ratio)
            ),
            frame_rate=FRAME_RATE,
            audio_sample_rate=pipeline.vocoder.config.output_sampling_rate,
        )

    def encode_prompt(self, text: str, max_sequence_length: int) -> LTX2Embeds:
        # LTX2Pipeline.__call__ step 3: Gemma's stacked hidden states, then the text connectors.
        pipeline = self.pipeline
        embeds, mask, _, _ = pipeline.encode_prompt(
            prompt=[text],
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
            device=self.device,
        )
        padding_side = getattr(pipeline.tokenizer, "padding_side", "left")
        video, audio, mask = pipeline.connectors(embeds, mask, padding_side=padding_side)
        return LTX2Embeds(video[0], audio[0], mask[0]).to(self.device, self.dtype)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int, sigmas, num_frames: int = 1) -> None:
        # LTX2Pipeline.__call__ step 5: linear sigmas (or the given ones), shifted by the video's tokens.
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        sigmas = np.linspace(1.0, 1 / num_steps, num_steps) if sigmas is None else list(sigmas)
        config = scheduler.config
        mu = calculate_shift(
            self.layout_of(height, width, num_frames).video_tokens,
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )
        scheduler.set_timesteps(sigmas=sigmas, mu=mu, device="cpu")

    def _min_inference_steps(self) -> int:
        # At the smallest video: the shift of the pipeline's default size can overflow for a tiny
        # VAE (millions of tokens); whether one step is finite does not depend on it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            side = self.spec.size_multiple
            _, sigmas = self.schedule(1, side, side, num_frames=1)
        return 1 if bool(torch.isfinite(sigmas).all()) else 2

    def layout_of(self, height: int, width: int, num_frames: int) -> JointLayout:
        """The layout of a video of `num_frames` frames of `height` x `width` pixels and its sound."""
        return _layout(
            self.spec,
            self.transformer.config.patch_size,
            self.transformer.config.patch_size_t,
            height,
            width,
            num_frames,
        )

    def layout(self, latents: torch.Tensor, height: int, width: int) -> JointLayout:
        """The layout of latents [B, N]: the frame count is the one whose layout is N long (the
        length grows strictly with it, so there is one)."""
        key = (latents.shape[-1], height, width)
        if key not in self._layouts:
            self._layouts[key] = _layout_of_length(self, *key)
        return self._layouts[key]

    def run_transformer(self, latents, sigmas, embeds: LTX2Embeds, guidance_scale, height, width) -> torch.Tensor:
        layout = self.layout(latents, height, width)
        video, audio = layout.split(latents)
        timestep = sigmas * self._scheduler.config.num_train_timesteps
        video_velocity, audio_velocity = self.velocities(video, audio, layout, embeds, timestep, timestep)
        return torch.cat([video_velocity.reshape(len(latents), -1), audio_velocity.reshape(len(latents), -1)], dim=1)

    def velocities(
        self,
        video: torch.Tensor,
        audio: torch.Tensor,
        layout: JointLayout,
        embeds: LTX2Embeds,
        timestep: torch.Tensor,
        video_timestep: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's velocities of the whole video's tokens [B, S_v, D_v] and the audio's
        frames [B, L_a, D_a]: the audio (and both cross-modal attentions) at `timestep` [B], the
        video at `video_timestep` ([B], or per token [B, S_v]), both on the 0..1000 scale."""
        batch, device = video.shape[0], video.device
        transformer = self.transformer
        video_coords = transformer.rope.prepare_video_coords(
            batch, layout.latent_frames, layout.latent_height, layout.latent_width, device, fps=FRAME_RATE
        )
        audio_coords = transformer.audio_rope.prepare_audio_coords(batch, layout.audio_frames, device)
        return transformer(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=embeds.prompt_embeds,
            audio_encoder_hidden_states=embeds.audio_prompt_embeds,
            timestep=video_timestep,
            audio_timestep=timestep,
            sigma=timestep,  # as the pipeline passes it (read by LTX-2.3's transformer)
            encoder_attention_mask=embeds.attention_mask,
            audio_encoder_attention_mask=embeds.attention_mask,
            num_frames=layout.latent_frames,
            height=layout.latent_height,
            width=layout.latent_width,
            fps=FRAME_RATE,
            audio_num_frames=layout.audio_frames,
            video_coords=video_coords,
            audio_coords=audio_coords,
            isolate_modalities=False,
            spatio_temporal_guidance_blocks=None,
            perturbation_mask=None,
            use_cross_timestep=True,  # the pipeline's default
            return_dict=False,
        )

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        layout = self.layout(latents, height, width)
        video, _ = layout.split(latents)
        return self.decode_video(video, layout)

    def decode_video(self, video: torch.Tensor, layout: JointLayout) -> torch.Tensor:
        """uint8 frames [B, F, 3, H, W] of the whole video's packed tokens [B, S_v, D_v]."""
        # LTX2Pipeline.__call__ after the loop: unpack, (decode timestep 0: no noise), denormalise, decode.
        pipeline, vae = self.pipeline, self.pipeline.vae
        video = pipeline._unpack_latents(
            video,
            layout.latent_frames,
            layout.latent_height,
            layout.latent_width,
            self.transformer.config.patch_size,
            self.transformer.config.patch_size_t,
        )
        video = pipeline._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        timestep = torch.zeros(video.shape[0], device=vae.device) if vae.config.timestep_conditioning else None
        frames = vae.decode(video.to(vae.device, vae.dtype), timestep, return_dict=False)[0]  # [B, 3, F, H, W]
        return images_to_uint8(frames.transpose(1, 2))

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        # LTX2Pipeline.__call__ after the loop: denormalise, unpack, the audio VAE's mel spectrogram, the vocoder.
        pipeline, audio_vae = self.pipeline, self.pipeline.audio_vae
        layout = self.layout(latents, height, width)
        _, audio = layout.split(latents)
        audio = pipeline._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        latent_mel_bins = audio_vae.config.mel_bins // pipeline.audio_vae_mel_compression_ratio
        audio = pipeline._unpack_audio_latents(audio, layout.audio_frames, num_mel_bins=latent_mel_bins)
        mel = audio_vae.decode(audio.to(audio_vae.device, audio_vae.dtype), return_dict=False)[0]
        return pipeline.vocoder(mel.to(pipeline.vocoder.dtype)).float().cpu()


def _layout(spec: ModelSpec, patch: int, patch_t: int, height: int, width: int, num_frames: int) -> JointLayout:
    latent_frames = (num_frames - 1) // spec.frame_multiple + 1
    latent_height, latent_width = height // spec.vae_scale_factor, width // spec.vae_scale_factor
    frame_tokens = (latent_height // patch) * (latent_width // patch)
    return JointLayout(
        latent_frames=latent_frames,
        latent_height=latent_height,
        latent_width=latent_width,
        video_tokens=(latent_frames // patch_t) * frame_tokens,
        video_features=spec.latent_channels * patch * patch * patch_t,
        audio_frames=spec.audio_latent_frames(num_frames),
        audio_features=spec.audio_features,
        given_tokens=spec.given_latent_frames * frame_tokens,  # one latent frame per token in time (patch_t 1)
    )


def _layout_of_length(adapter: LTX2Adapter, length: int, height: int, width: int) -> JointLayout:
    latent_frames = 1
    while True:
        num_frames = (latent_frames - 1) * adapter.spec.frame_multiple + 1
        layout = adapter.layout_of(height, width, num_frames)
        size = layout.video_size + layout.audio_frames * layout.audio_features
        if size == length:
            return layout
        if size > length:
            raise ValueError(
                f"latents of {length} elements are no video of {height}x{width} with its audio for "
                f"{adapter.pipeline_class} (latent frame counts give {size} at {latent_frames} frames)"
            )
        latent_frames += 1
