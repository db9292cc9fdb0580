"""A tiny `FluxPipeline` (FLUX.1-dev's layout: guidance-distilled, CLIP pooled + T5 tokens, 2x2
packed latents), all random."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.pipelines.families.sd3.tiny import tiny_autoencoder_kl
from rollout.pipelines.sampling_defaults import SamplingDefaults
from rollout.pipelines.tiny.builder import Preset, block_sizes, published_config, real_sizes, small_sizes, tiny_builder
from rollout.pipelines.tiny.saving import TINY_IMAGE, save
from rollout.pipelines.tiny.text_encoders import clip_text_encoder, t5_encoder
from rollout.pipelines.tiny.tokenizers import clip_tokenizer, t5_tokenizer

# FLUX.1-dev's scheduler_config.json: the shift grows with the image's token count.
FLUX_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


@dataclass(frozen=True)
class TinyFluxSizes:
    """Sizes of the tiny pipeline: 32x32 images from 16x16x4 latents, packed into 64 tokens of 16."""

    latent_channels: int = 4
    num_layers: int = 1  # double-stream (joint) blocks
    num_single_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)  # sums to attention_head_dim
    text_hidden_size: int = 32  # CLIP's width (its pooled output conditions the transformer)
    t5_hidden_size: int | None = None  # T5's width, the transformer's text width; None: text_hidden_size
    text_layers: int = 2
    vae_block_out_channels: tuple[int, ...] = (8, 16)  # two blocks: the VAE downsamples by 2
    guidance_embeds: bool = True  # FLUX.1-dev (False: FLUX.1-schnell)
    sampling_defaults: SamplingDefaults | None = TINY_IMAGE  # an unsized request's (None: the pipeline's)


@tiny_builder(TinyFluxSizes())
def build_tiny_flux(
    path, seed, sizes, transformer_config, device, dtype, pipeline_class: str = "FluxPipeline"
) -> Path:
    """A tiny `FluxPipeline` (a `TinyBuilder`). `pipeline_class`: "FluxKontextPipeline" saves the same
    components as FLUX.1 Kontext (the same transformer class)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    tokenizer = clip_tokenizer()
    tokenizer_2 = t5_tokenizer()
    text_width = sizes.t5_hidden_size or sizes.text_hidden_size
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = FluxTransformer2DModel(
            **transformer_config
            or {
                "patch_size": 1,
                "in_channels": 4 * sizes.latent_channels,  # packed 2x2 patches
                **block_sizes(sizes),
                "num_single_layers": sizes.num_single_layers,
                "joint_attention_dim": text_width,
                "pooled_projection_dim": sizes.text_hidden_size,
                "guidance_embeds": sizes.guidance_embeds,
                "axes_dims_rope": sizes.axes_dims_rope,
            }
        )
        vae = tiny_autoencoder_kl(sizes.latent_channels, sizes.vae_block_out_channels, 32)
        text_encoder = clip_text_encoder(tokenizer, sizes.text_hidden_size, sizes.text_layers, with_projection=False)
        text_encoder_2 = t5_encoder(tokenizer_2, text_width)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    text = dict(text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)
    pipeline = getattr(diffusers, pipeline_class)(scheduler=scheduler, vae=vae, transformer=transformer, **text)
    defaults = sizes.sampling_defaults
    if pipeline_class == "FluxKontextPipeline" and defaults is not None:
        # Kontext's auto_resize (its pipeline's default) resizes a tiny input image to about a
        # megapixel (PREFERRED_KONTEXT_RESOLUTIONS): 65536 tokens through the tiny VAE's scale of 2.
        defaults = dataclasses.replace(defaults, auto_resize=False)
    return save(pipeline, path, dtype, defaults)


# Benchmark presets (benchmarks/model_presets.py), as in families/sd3/tiny.py.

# FLUX.1-dev's transformer/config.json.
FLUX1_DEV = published_config(__file__, "flux1_dev.json")


# The small preset's transformer: 2 joint and 4 single blocks (of `SMALL_PARTS`' 4 x 32 heads).
SMALL_SIZES = small_sizes(TinyFluxSizes, num_layers=2, num_single_layers=4, axes_dims_rope=(8, 12, 12))
# FLUX.1-dev's transformer (12B parameters) with random weights, one-layer text encoders of the real
# widths (CLIP-L's 768, T5's 4096), and a narrow VAE with the real scale factor and latent channels.
REAL_SIZES = real_sizes(TinyFluxSizes, latent_channels=16, text_hidden_size=768, t5_hidden_size=4096)
build_small_flux = Preset(build_tiny_flux, SMALL_SIZES)
build_real_flux = Preset(build_tiny_flux, REAL_SIZES, FLUX1_DEV)


# FLUX.1 Kontext: FLUX.1's components under FluxKontextPipeline. FLUX.1-Kontext-dev's
# transformer/config.json is FLUX.1-dev's (the input image's tokens only lengthen the sequence).
FLUX1_KONTEXT_DEV = FLUX1_DEV


def build_tiny_flux_kontext(path: str | Path, seed: int = 0, **kwargs) -> Path:
    """A tiny `FluxKontextPipeline` (see `build_tiny_flux`)."""
    return build_tiny_flux(path, seed=seed, pipeline_class="FluxKontextPipeline", **kwargs)


build_small_flux_kontext = Preset(build_tiny_flux_kontext, SMALL_SIZES)
build_real_flux_kontext = Preset(build_tiny_flux_kontext, REAL_SIZES, FLUX1_KONTEXT_DEV)
