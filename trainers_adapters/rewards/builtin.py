"""Rewards: callables `(images, prompts, metadata) -> tensor [N] float32`, higher is better.

images: uint8 [N, 3, H, W] (or a list of [3, H, W]); for a video model uint8 videos
[N, F, 3, H, W]; prompts: N strings; metadata: N dicts (for an edit, "input_images": the prompt's
input images, a list of uint8 [3, H, W]; for a video with sound, "audio": its waveform, float32
[channels, samples], and "audio_sample_rate"). The built-ins need no downloaded model. A user's reward is
named by dotted path.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Sequence

import torch
from PIL import Image

from rollout.imports import import_by_path

Reward = Callable[[torch.Tensor, Sequence[str], Sequence[dict]], torch.Tensor]

# Target colours (RGB in [0, 1]) a prompt can name.
COLOURS = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
    "orange": (1.0, 0.5, 0.0),
    "purple": (0.5, 0.0, 0.5),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
}


def _stack(images) -> torch.Tensor:
    images = torch.stack(list(images)) if not isinstance(images, torch.Tensor) else images
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be uint8 [N, 3, H, W], got {images.dtype} {tuple(images.shape)}")
    return images


def _jpeg_kilobytes(images) -> torch.Tensor:
    sizes = []
    for image in _stack(images):
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


def jpeg_compressibility(images, prompts, metadata) -> torch.Tensor:
    """Minus the JPEG size in kB (DDPO's compressibility reward): simpler images score higher."""
    return -_jpeg_kilobytes(images)


def jpeg_incompressibility(images, prompts, metadata) -> torch.Tensor:
    """The JPEG size in kB: more detailed images score higher."""
    return _jpeg_kilobytes(images)


def colour_target(images, prompts, metadata) -> torch.Tensor:
    """Closeness of the image's mean colour to the colour the prompt names ("a red square" -> red):
    minus the Euclidean distance in RGB [0, 1], so 0 is a perfect match and -sqrt(3) the worst."""
    images = _stack(images)
    targets = torch.tensor([COLOURS[_named_colour(prompt)] for prompt in prompts], dtype=torch.float32)
    means = images.float().mean(dim=(2, 3)) / 255
    return -(means - targets).norm(dim=1)


def colour_agreement(videos, prompts, metadata) -> torch.Tensor:
    """How steady a video's colour is over time: minus the mean distance (RGB in [0, 1]) of each
    frame's mean colour from the whole video's. 0 for a video whose frames all share one mean
    colour; it needs the time axis, so an image reward cannot stand in for it."""
    videos = torch.stack(list(videos)) if not isinstance(videos, torch.Tensor) else videos
    if videos.dtype != torch.uint8 or videos.ndim != 5 or videos.shape[2] != 3:
        raise ValueError(f"videos must be uint8 [N, F, 3, H, W], got {videos.dtype} {tuple(videos.shape)}")
    frame_means = videos.float().mean(dim=(3, 4)) / 255  # [N, F, 3]
    return -(frame_means - frame_means.mean(dim=1, keepdim=True)).norm(dim=2).mean(dim=1)


def audio_loudness(images, prompts, metadata) -> torch.Tensor:
    """How loud a video's sound is: the root mean square of its waveform (metadata[i]["audio"],
    float32 [channels, samples] in [-1, 1], which a video model with sound gives: LTX-2)."""
    missing = [i for i, m in enumerate(metadata) if m.get("audio") is None]
    if missing:
        raise ValueError(
            f"audio_loudness scores sound, but samples {missing[:5]} carry no audio in their metadata; "
            "it needs a video model that makes sound (LTX-2)"
        )
    return torch.stack([m["audio"].float().pow(2).mean().sqrt() for m in metadata])


# How much keeping the input's layout counts against reaching the colour in `colour_edit`.
LAYOUT_WEIGHT = 0.2


def colour_edit(images, prompts, metadata) -> torch.Tensor:
    """An edit that turns the input image's colour into the one the prompt names ("make it red")
    while keeping its layout: `colour_target`'s closeness of the output's mean colour, minus
    `LAYOUT_WEIGHT` x how far the output's brightness pattern moved from the input's (the mean
    absolute difference of the two grey images, each standardised to mean 0 and std 1, the input
    resized to the output's size). Needs both images: metadata[i]["input_images"][0] is the input."""
    images = _stack(images)
    missing = [i for i, m in enumerate(metadata) if not m.get("input_images")]
    if missing:
        raise ValueError(
            f"colour_edit scores edits, but samples {missing[:5]} carry no input_images in their metadata; "
            "give the rollout input images (a recipe's input_images section)"
        )
    inputs = torch.stack(
        [
            torch.nn.functional.interpolate(
                m["input_images"][0][None].float(), size=images.shape[2:], mode="bilinear", antialias=True
            )[0]
            for m in metadata
        ]
    )
    layout = (_standardised_grey(images.float()) - _standardised_grey(inputs)).abs().mean(dim=(1, 2))
    return colour_target(images, prompts, metadata) - LAYOUT_WEIGHT * layout


def _standardised_grey(images: torch.Tensor) -> torch.Tensor:
    grey = images.mean(dim=1)  # [N, H, W]
    mean, std = grey.mean(dim=(1, 2), keepdim=True), grey.std(dim=(1, 2), keepdim=True)
    return (grey - mean) / (std + 1.0)  # +1 (of 255): a flat image stays flat instead of blowing up noise


def _named_colour(prompt: str) -> str:
    for word in re.findall(r"[a-z]+", prompt.lower()):
        if word in COLOURS:
            return word
    raise ValueError(f"prompt {prompt!r} names no colour; the colour reward knows {sorted(COLOURS)}")


BUILTIN_REWARDS: dict[str, Reward] = {
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "colour": colour_target,
    "colour_agreement": colour_agreement,
    "colour_edit": colour_edit,
    "audio_loudness": audio_loudness,
}


def get_reward(name: str) -> Reward:
    """A built-in reward by name, or a user's callable by dotted path ("pkg.module.my_reward")."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if "." not in name:
        raise ValueError(f"unknown reward {name!r}; built-ins: {sorted(BUILTIN_REWARDS)}, or a dotted path")
    reward = import_by_path(name, "reward")
    if not callable(reward):
        raise ValueError(f"reward {name!r} is not callable")
    return reward
