"""The model families the tests run on: their tiny pipelines and how their requests turn
classifier-free guidance on and off (SD3 through `guidance_scale`, FLUX.1 and Qwen-Image through
`true_cfg_scale` with a negative prompt)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rollout import SamplingParams
from rollout.pipelines.tiny import build_tiny_flux, build_tiny_qwen_image, build_tiny_sd3


@dataclass(frozen=True)
class Family:
    name: str
    pipeline_class: str
    build: Callable
    cfg: dict = field(default_factory=dict)  # SamplingParams fields that turn CFG on
    no_cfg: dict = field(default_factory=dict)  # ... and off

    def params(self, cfg: bool = False, **kwargs) -> SamplingParams:
        """Sampling params for this family's tiny model: 32x32 images, CFG on or off."""
        return SamplingParams(**{"height": 32, "width": 32, **(self.cfg if cfg else self.no_cfg), **kwargs})


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
