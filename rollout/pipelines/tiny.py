"""Tiny Stable Diffusion 3 pipelines of the real diffusers/transformers classes, with random weights.

Tests, demos and benchmarks cannot download weights, so they build a pipeline here, save it with
`save_pretrained`, and load it back with the real `from_pretrained` code. The CLIP tokenizer is a
byte-level one written locally (every byte is a token, no merges), which the real `CLIPTokenizer`
reads like any other vocabulary. There is no T5 encoder: SD3 then feeds zeros in its place, as
diffusers does for `text_encoder_3=None`.

The VAE decoder is random too, but set close to a colour map (`make_decoder_colour_faithful`), so
an image's colours follow its latents and the demo's colour reward is something a policy can learn.

    python -m rollout.pipelines.tiny OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TinySD3Sizes:
    """Sizes of the tiny pipeline. The defaults give 32x32 images from 16x16x4 latents."""

    sample_size: int = 16  # latent height/width the transformer is built for
    patch_size: int = 2
    latent_channels: int = 4
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    text_hidden_size: int = 32  # CLIP width; pooled projections are 2 * this
    text_layers: int = 2
    vae_block_out_channels: tuple[int, ...] = (8, 16)  # two blocks: the VAE downsamples by 2


def _byte_to_unicode() -> dict[int, str]:
    """The byte-to-printable-character table that byte-level BPE vocabularies (GPT-2, CLIP) use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_byte_level_clip_tokenizer(folder: Path) -> int:
    """Write vocab.json and merges.txt of a CLIP tokenizer whose tokens are single bytes.

    Returns the vocabulary size.
    """
    folder.mkdir(parents=True, exist_ok=True)
    vocab: dict[str, int] = {}
    for char in _byte_to_unicode().values():
        vocab[char] = len(vocab)
    for char in _byte_to_unicode().values():
        vocab[char + "</w>"] = len(vocab)  # CLIP marks the last character of a word
    vocab[BOS_TOKEN] = len(vocab)
    vocab[EOS_TOKEN] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return len(vocab)


def _text_encoder(sizes: TinySD3Sizes, vocab: dict[str, int]):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=sizes.text_hidden_size,
        intermediate_size=2 * sizes.text_hidden_size,
        num_hidden_layers=sizes.text_layers,
        num_attention_heads=2,
        projection_dim=sizes.text_hidden_size,
        max_position_embeddings=77,
        bos_token_id=vocab[BOS_TOKEN],
        eos_token_id=vocab[EOS_TOKEN],
        pad_token_id=vocab[EOS_TOKEN],
        hidden_act="gelu",
    )
    return CLIPTextModelWithProjection(config)


# Colour (RGB, before the decoder's [-1, 1] -> [0, 1] map) that each of the first latent channels paints.
_CHANNEL_COLOURS = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.5, 0.5, 0.5))
_TEXTURE_SCALE = 0.1  # what is left of the random weights: a little texture on top of the colour map


@torch.no_grad()
def make_decoder_colour_faithful(vae) -> None:
    """Turn a random `AutoencoderKL` decoder into roughly "latent channel c paints colour c".

    With random weights every latent decodes to nearly the same mean colour (measured: a per-image
    std of 0.002 in [0, 1] RGB), so no policy could learn a colour reward. Here each residual
    branch keeps only a tenth of its random weights (a near-identity block), the input conv copies
    the latent channels into the first feature channels, the upsampler and the channel-reducing
    shortcut pass features through, and the output conv paints the first channels with
    `_CHANNEL_COLOURS`. An offset of 1 in one latent channel then moves the image's mean colour by
    about 0.2 towards that channel's colour.
    """
    decoder = vae.decoder
    latent_channels = decoder.conv_in.in_channels
    _scale_and_add_identity(decoder.conv_in, latent_channels)
    for resnet in [*decoder.mid_block.resnets, *(r for block in decoder.up_blocks for r in block.resnets)]:
        _scale_and_add_identity(resnet.conv2, 0)
        if resnet.conv_shortcut is not None:
            _scale_and_add_identity(resnet.conv_shortcut, resnet.conv_shortcut.out_channels, texture=0.0)
    for block in decoder.up_blocks:
        for upsampler in block.upsamplers or []:
            _scale_and_add_identity(upsampler.conv, upsampler.conv.out_channels)
    for attention in decoder.mid_block.attentions:
        attention.to_out[0].weight.mul_(_TEXTURE_SCALE)
        attention.to_out[0].bias.zero_()
    conv_out = decoder.conv_out
    _scale_and_add_identity(conv_out, 0)
    centre = conv_out.kernel_size[0] // 2
    for channel, colour in enumerate(_CHANNEL_COLOURS[:latent_channels]):
        conv_out.weight[:, channel, centre, centre] += torch.tensor(colour)


def _scale_and_add_identity(conv: torch.nn.Conv2d, channels: int, texture: float = _TEXTURE_SCALE) -> None:
    """conv.weight *= texture, then input channel i feeds output channel i (i < channels) through
    the kernel's centre; the bias is zeroed."""
    conv.weight.mul_(texture)
    centre = conv.kernel_size[0] // 2
    conv.weight[range(channels), range(channels), centre, centre] += 1.0
    conv.bias.zero_()


def build_tiny_sd3(path: str | Path, seed: int = 0, sizes: TinySD3Sizes = TinySD3Sizes()) -> Path:
    """Build a `StableDiffusion3Pipeline` with random weights and save it to `path`.

    Returns `path`. Building is deterministic in `seed`; a folder that already holds a pipeline is
    overwritten.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTokenizer

    path = Path(path)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        write_byte_level_clip_tokenizer(Path(tokenizer_dir))
        tokenizer = CLIPTokenizer(
            str(Path(tokenizer_dir) / "vocab.json"),
            str(Path(tokenizer_dir) / "merges.txt"),
            bos_token=BOS_TOKEN,
            eos_token=EOS_TOKEN,
            pad_token=EOS_TOKEN,
            unk_token=EOS_TOKEN,
            model_max_length=77,
        )
    vocab = tokenizer.get_vocab()

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=sizes.sample_size,
        patch_size=sizes.patch_size,
        in_channels=sizes.latent_channels,
        out_channels=sizes.latent_channels,
        num_layers=sizes.num_layers,
        attention_head_dim=sizes.attention_head_dim,
        num_attention_heads=sizes.num_attention_heads,
        caption_projection_dim=sizes.attention_head_dim * sizes.num_attention_heads,
        # The two CLIP encoders are concatenated along features before joint attention.
        joint_attention_dim=2 * sizes.text_hidden_size,
        pooled_projection_dim=2 * sizes.text_hidden_size,
        pos_embed_max_size=max(sizes.sample_size, 16),
    )
    num_blocks = len(sizes.vae_block_out_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * num_blocks,
        up_block_types=("UpDecoderBlock2D",) * num_blocks,
        block_out_channels=sizes.vae_block_out_channels,
        layers_per_block=1,
        latent_channels=sizes.latent_channels,
        # One group: per-channel GroupNorm would erase each latent channel's mean, and with it every
        # way for the latents to set an image's overall colour.
        norm_num_groups=1,
        sample_size=sizes.sample_size * 2 ** (num_blocks - 1),
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    make_decoder_colour_faithful(vae)
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=_text_encoder(sizes, vocab),
        tokenizer=tokenizer,
        text_encoder_2=_text_encoder(sizes, vocab),
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipeline.save_pretrained(path)
    logger.info("saved a tiny StableDiffusion3Pipeline to %s", path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.pipelines.tiny",
        description="Build a tiny StableDiffusion3Pipeline with random weights and save it to a folder.",
    )
    parser.add_argument("out_dir", help="folder to write the pipeline to (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_tiny_sd3(args.out_dir, seed=args.seed)


if __name__ == "__main__":
    main()
