"""Tiny `LTX2Pipeline`s and `LTX2ImageToVideoPipeline`s (the same components): LTX-2's audio-video
transformer, its video and audio VAEs, vocoder and text connectors, with a Gemma 3 text encoder, all
random and small; plus the benchmark presets.

The tiny sizes are those of diffusers' own LTX-2 tests (tests/pipelines/ltx2/testing_utils.py): a
video VAE that halves space and time (32x32 frames, 9 frames are 4-channel latents of 5 x 16 x 16),
an audio VAE of 8 mel bins in 2 latent channels of 2 bins, and a two-layer transformer. The
scheduler is LTX-2's (its shift grows with the video's token count), and both VAEs get latent
statistics that are not the identity, so the pipeline's normalisations are exercised.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.sampling_defaults import SamplingDefaults
from rollout.pipelines.tiny.builder import Preset, published_config, tiny_builder
from rollout.pipelines.tiny.saving import TINY_VIDEO, save
from rollout.pipelines.tiny.text_encoders import gemma3_encoder
from rollout.pipelines.tiny.tokenizers import gemma_tokenizer

# LTX-2's scheduler config (Lightricks/LTX-2, scheduler/scheduler_config.json): the shift follows the
# video's token count between 1024 and 4096 tokens, exponential time shift, stretched to end at 0.1.
LTX2_SCHEDULER = {
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
    "time_shift_type": "exponential",
}


@dataclass(frozen=True)
class TinyLTX2Sizes:
    """Sizes of the tiny pipeline (see the module's docstring)."""

    latent_channels: int = 4
    audio_latent_channels: int = 2
    mel_bins: int = 8
    text_width: int = 32  # the connectors' 4 heads x 8
    text_layers: int = 1
    num_layers: int = 2
    sampling_defaults: SamplingDefaults | None = TINY_VIDEO  # an unsized request's (None: the pipeline's)


def ltx2_transformer_config(sizes: TinyLTX2Sizes) -> dict:
    audio_features = sizes.audio_latent_channels * (sizes.mel_bins // 4)  # the audio VAE's mel compression: 4
    return {
        "in_channels": sizes.latent_channels,
        "out_channels": sizes.latent_channels,
        "patch_size": 1,
        "patch_size_t": 1,
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "cross_attention_dim": 16,
        "audio_in_channels": audio_features,
        "audio_out_channels": audio_features,
        "audio_num_attention_heads": 2,
        "audio_attention_head_dim": 4,
        "audio_cross_attention_dim": 8,
        "num_layers": sizes.num_layers,
        "qk_norm": "rms_norm_across_heads",
        "caption_channels": sizes.text_width,
        "rope_double_precision": False,
        "rope_type": "split",
    }


@tiny_builder(TinyLTX2Sizes())
def build_tiny_ltx2(path, seed, sizes, transformer_config, device, dtype, image_to_video: bool = False) -> Path:
    """A tiny `LTX2Pipeline` (a `TinyBuilder`; `image_to_video`: an `LTX2ImageToVideoPipeline`, whose
    components are the same). The text encoder's width follows `transformer_config`'s
    `caption_channels` (the presets pass larger transformers)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2ImageToVideoPipeline, LTX2Pipeline

    config = transformer_config or ltx2_transformer_config(sizes)
    text_width = config["caption_channels"]
    tokenizer = gemma_tokenizer()
    torch.manual_seed(seed)
    with torch.device(device):
        text_encoder = gemma3_encoder(tokenizer, text_width, sizes.text_layers)
        connectors = ltx2_connectors(text_width, sizes.text_layers)
        transformer = ltx2_transformer(config)
        vae = ltx2_video_vae(sizes.latent_channels)
        audio_vae, vocoder = ltx2_audio(sizes)
    pipeline_class = LTX2ImageToVideoPipeline if image_to_video else LTX2Pipeline
    scheduler = FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER)
    text = dict(text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors)
    sound = dict(audio_vae=audio_vae, vocoder=vocoder)
    pipeline = pipeline_class(scheduler=scheduler, vae=vae, transformer=transformer, **text, **sound)
    return save(pipeline, path, dtype, sizes.sampling_defaults)


def build_tiny_ltx2_i2v(path: str | Path, seed: int = 0, **options) -> Path:
    """Build a tiny `LTX2ImageToVideoPipeline`: the tiny LTX-2's components (so its first frame
    encodes to 4 channels of 16x16 at 32x32); takes `build_tiny_ltx2`'s options."""
    return build_tiny_ltx2(path, seed, image_to_video=True, **options)


def ltx2_transformer(config: dict):
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel(**config)


def ltx2_connectors(text_width: int, text_layers: int):
    """The text connectors: the encoder's stacked hidden states (every layer and the embeddings)
    projected, then one attention layer per modality; 4 heads of text_width / 4."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    heads = 4
    return LTX2TextConnectors(
        caption_channels=text_width,
        text_proj_in_factor=text_layers + 1,
        video_connector_num_attention_heads=heads,
        video_connector_attention_head_dim=text_width // heads,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=heads,
        audio_connector_attention_head_dim=text_width // heads,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_theta=10000.0,
        rope_double_precision=False,
        causal_temporal_positioning=False,
        rope_type="split",
    )


@torch.no_grad()
def ltx2_video_vae(latent_channels: int):
    """diffusers' test VAE: one block that halves space and time; latent statistics not the identity."""
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.latents_mean.copy_(0.1 * torch.randn(latent_channels))
    vae.latents_std.copy_(1.0 + 0.2 * torch.rand(latent_channels))
    return vae


@torch.no_grad()
def ltx2_audio(sizes: TinyLTX2Sizes):
    """The audio VAE (mel spectrograms of `mel_bins` bins, 4x compressed in time and bins) and the
    vocoder that turns its stereo spectrograms into 16 kHz waveforms."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    features = sizes.audio_latent_channels * (sizes.mel_bins // 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=features,  # its latent statistics are per packed feature (channels x bins)
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=sizes.audio_latent_channels,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=sizes.mel_bins,
    )
    audio_vae.latents_mean.copy_(0.1 * torch.randn(features))
    audio_vae.latents_std.copy_(1.0 + 0.2 * torch.rand(features))
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * sizes.mel_bins,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    )
    return audio_vae, vocoder


# Benchmark presets (benchmarks/model_presets.py), as in families/wan/tiny.py.

# LTX-2's transformer (19B, Lightricks/LTX-2 transformer/config.json): 48 layers of 32 x 128 video
# heads and 32 x 64 audio heads, 128 latent channels each side, Gemma 3 12B's 3840-wide text.
LTX2_19B = published_config(__file__, "ltx2_19b.json")
# The small preset: the tiny latents and text, 4 layers of 4 x 32 video heads (2 x 32 audio heads).
LTX2_SMALL = ltx2_transformer_config(TinyLTX2Sizes()) | {
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "cross_attention_dim": 128,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 32,
    "audio_cross_attention_dim": 64,
    "num_layers": 4,
}


# LTX-2 with the `LTX2_SMALL` transformer, the tiny text encoder, VAEs and vocoder (and as an
# `LTX2ImageToVideoPipeline`).
build_small_ltx2 = Preset(build_tiny_ltx2, None, LTX2_SMALL)
build_small_ltx2_i2v = Preset(build_tiny_ltx2_i2v, None, LTX2_SMALL)
# The real preset's narrow VAEs of LTX-2's latent widths (128 video channels; 8 audio channels of 16 bins),
# and the published pipeline's default size and frames.
REAL_LTX2_SIZES = TinyLTX2Sizes(latent_channels=128, audio_latent_channels=8, mel_bins=64, sampling_defaults=None)


# LTX-2's 19B transformer with random weights, a one-layer Gemma 3 of the real text width, and narrow
# VAEs of the real latent widths (`REAL_LTX2_SIZES`), which compress as the tiny ones do (space and
# time by 2), not as LTX-2's (space 32, time 8); and the same as an `LTX2ImageToVideoPipeline` (LTX-2
# 19B takes both).
build_real_ltx2 = Preset(build_tiny_ltx2, REAL_LTX2_SIZES, LTX2_19B)
build_real_ltx2_i2v = Preset(build_tiny_ltx2_i2v, REAL_LTX2_SIZES, LTX2_19B)
