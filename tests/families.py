"""The model families the tests run on: their tiny pipelines and how their requests turn
classifier-free guidance on and off (SD3 through `guidance_scale`, FLUX.1 and Qwen-Image through
`true_cfg_scale` with a negative prompt)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rollout import SamplingParams
from rollout.pipelines.tiny import (
    build_tiny_flux,
    build_tiny_qwen_image,
    build_tiny_sd3,
    build_tiny_wan,
    build_tiny_wan22,
)


@dataclass(frozen=True)
class Family:
    name: str
    pipeline_class: str
    build: Callable
    cfg: dict = field(default_factory=dict)  # SamplingParams fields that turn CFG on
    no_cfg: dict = field(default_factory=dict)  # ... and off

    extra: dict = field(default_factory=dict)  # SamplingParams fields every request sets (frames of a video)

    def params(self, cfg: bool = False, **kwargs) -> SamplingParams:
        """Sampling params for this family's tiny model: 32x32 images (or 9-frame videos), CFG on or off."""
        fields = {"height": 32, "width": 32, **self.extra, **(self.cfg if cfg else self.no_cfg), **kwargs}
        return SamplingParams(**fields)


FAMILIES = {
    "sd3": Family(
        "sd3", "StableDiffusion3Pipeline", build_tiny_sd3, cfg={"guidance_scale": 4.5}, no_cfg={"guidance_scale": 1.0}
    ),
    "flux": Family(
        "flux", "FluxPipeline", build_tiny_flux, cfg={"true_cfg_scale": 3.0, "negative_prompt": "blurry, dark"}
    ),
    "qwen_image": Family(
        "qwen_image", "QwenImagePipeline", build_tiny_qwen_image, cfg={"true_cfg_scale": 4.0, "negative_prompt": " "}
    ),
}
# Video families: their outputs are `video`, not `image`, so the image tests do not run on them.
VIDEO_FAMILIES = {
    "wan": Family(
        "wan",
        "WanPipeline",
        build_tiny_wan,
        cfg={"guidance_scale": 4.0},
        no_cfg={"guidance_scale": 1.0},
        extra={"num_frames": 9},
    ),
    "wan22": Family(
        "wan22",
        "WanPipeline",
        build_tiny_wan22,
        cfg={"guidance_scale": 4.0, "guidance_scale_2": 3.0},
        no_cfg={"guidance_scale": 1.0},
        extra={"num_frames": 9},
    ),
}
ALL_FAMILIES = FAMILIES | VIDEO_FAMILIES
