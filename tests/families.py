"""The model families the tests run on: every descriptor in `rollout.pipelines.families`, with the
sizes of its tiny pipeline's requests. How a family's requests turn classifier-free guidance on and
off is the descriptor's (`Family.cfg_on` / `cfg_off`), so tests and benchmarks guide alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from rollout import SamplingParams
from rollout.pipelines import family as family_module
from rollout.pipelines.families import FAMILIES as DESCRIPTORS

TINY_SIZE = {"height": 32, "width": 32}  # every tiny pipeline's images (and video frames)
TINY_NUM_FRAMES = 9  # a tiny video: 5 latent frames (the tiny VAE halves time after the first frame)


@dataclass(frozen=True)
class Family:
    descriptor: family_module.Family

    @property
    def name(self) -> str:
        return self.descriptor.name

    @property
    def pipeline_class(self) -> str:
        return self.descriptor.pipeline_class

    @property
    def build(self) -> Callable:
        return self.descriptor.build_tiny

    @property
    def cfg(self) -> dict:
        """SamplingParams fields that turn CFG on."""
        return self.descriptor.guidance_fields(cfg=True)

    @property
    def no_cfg(self) -> dict:
        """... and off."""
        return self.descriptor.guidance_fields(cfg=False)

    @property
    def extra(self) -> dict:
        """SamplingParams fields every request sets (frames of a video)."""
        return {"num_frames": TINY_NUM_FRAMES} if self.descriptor.video else {}

    def params(self, cfg: bool = False, **kwargs) -> SamplingParams:
        """Sampling params for this family's tiny model: 32x32 images (or 9-frame videos), CFG on or off."""
        fields = {**TINY_SIZE, **self.extra, **(self.cfg if cfg else self.no_cfg), **kwargs}
        return SamplingParams(**fields)


FAMILIES = {d.name: Family(d) for d in DESCRIPTORS if not d.video}
# Video families: their outputs are `video`, not `image`, so the image tests do not run on them.
VIDEO_FAMILIES = {d.name: Family(d) for d in DESCRIPTORS if d.video}
ALL_FAMILIES = FAMILIES | VIDEO_FAMILIES

# The families whose matrix tests (parity, re-scoring, batching, the tiny pipeline) run in the default
# suite; every other family's run in the slow suite (CI runs both), so that a new family does not
# push the default suite over its budget. These three cover the three latent layouts: SD3's image
# latents, FLUX.1's packed tokens, Qwen-Image's packed tokens with a text mask.
DEFAULT_MATRIX = ("sd3", "flux", "qwen_image")


def matrix(families: dict[str, Family] | None = None) -> list:
    """Pytest params over `families` (default: the image families): a family outside DEFAULT_MATRIX
    is marked slow."""
    names = list(FAMILIES if families is None else families)
    return [name if name in DEFAULT_MATRIX else pytest.param(name, marks=pytest.mark.slow) for name in names]
