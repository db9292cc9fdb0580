"""Admission by work: a request is refused, before anything runs, where one unit of its work would
run so long that the engine would take its step for hung; batches of a large size hold only as
many samples as fit.

The executor declares a step hung once no unit of work has started in it for `step_timeout_s`
(`executors.base`); a unit is a transformer block, a text encoder's layer, or one of a VAE's
resnets, attentions and samplers (`rollout.worker.progress`). So the longest unit, not the whole
step, is what must fit, and its work grows with the request's size: attention quadratically in
tokens (FLUX.1 Kontext's forward sees the output's and its input image's tokens; a VAE's mid-block
attention every latent pixel of an image), the rest linearly. Each worker measures at start what
each unit does per sample as a function of size, and how fast its device runs
(`rollout.worker.work_profile.WorkProfile`); here that gives a request's longest unit in seconds:

- per request: its texts and input images, encoded once, one at a time;
- per sample: a forward row (two where classifier-free guidance shares the conditional rows'
  pass) and a decode; a batch of n samples does n times that in each unit.

A request whose longest unit would take more than `UNIT_SHARE` of `step_timeout_s` is refused with
the size that would fit; the margin is for what the estimate leaves out (work between the
counted operations, a machine busy with other work). A request that fits runs in batches of at
most `samples_per_batch` samples (`Request.max_batch`, which the scheduler keeps to).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rollout.model_spec import ModelSpec
from rollout.sampling_params import SamplingParams
from rollout.worker.work_profile import WorkProfile, denoised_pixels, encoded_pixels, latent_frames

# The most of `step_timeout_s` one unit of work may take by the estimate.
UNIT_SHARE = 0.25


@dataclass(frozen=True)
class LongestUnits:
    """A request's longest unit once per request (encoding) and per sample (a forward row or a
    decode): (seconds, the unit's name)."""

    per_request: tuple[float, str]
    per_sample: tuple[float, str]


class WorkBudget:
    """What one unit of work may take on this engine, and what a request's units would take."""

    def __init__(self, profile: WorkProfile, spec: ModelSpec, step_timeout_s: float, max_batch_size: int):
        self.profile = profile
        self.spec = spec
        self.step_timeout_s = step_timeout_s
        self.max_batch_size = max_batch_size

    @property
    def unit_limit_s(self) -> float:
        return UNIT_SHARE * self.step_timeout_s

    def longest_units(
        self, params: SamplingParams, encoded: Sequence[int], output_scale: float = 1.0, input_scale: float = 1.0
    ) -> LongestUnits:
        """The longest units of a request with (resolved) `params` whose input images are encoded
        at `encoded` pixels each; the scales multiply the output's and the input images' pixels
        (what `problems` searches for a size that fits)."""
        spec, profile = self.spec, self.profile
        pixels = params.height * params.width * output_scale
        encoded = [count * input_scale for count in encoded]
        frames = latent_frames(spec, params.num_frames)
        sizes = {
            "encode": encoded_pixels(spec, pixels, encoded),
            "denoise": denoised_pixels(spec, pixels, encoded),
            "decode": pixels,
        }
        rows = 2 if params.negative_prompt is not None and profile.cfg_in_one_pass else 1
        per_request, per_sample = (0.0, ""), (0.0, "")
        for unit in profile.units:
            seconds = profile.seconds(unit, sizes[unit.phase], frames)
            if unit.phase == "encode":
                per_request = max(per_request, (seconds, unit.name))
            else:
                per_sample = max(per_sample, (seconds * (rows if unit.phase == "denoise" else 1), unit.name))
        return LongestUnits(per_request, per_sample)

    def samples_per_batch(self, params: SamplingParams, encoded: Sequence[int]) -> int:
        """The most samples of this request's size one batch may hold for its units to fit."""
        per_sample, _ = self.longest_units(params, encoded).per_sample
        if per_sample <= 0:
            return self.max_batch_size
        return max(1, min(self.max_batch_size, math.floor(self.unit_limit_s / per_sample)))

    def problems(self, params: SamplingParams, encoded: Sequence[int]) -> list[str]:
        """Why a request with (resolved) `params` and input images encoded at `encoded` pixels
        cannot run on this engine within its step timeout (empty: it can), naming the size that
        would fit."""
        longest = self.longest_units(params, encoded)
        seconds, name = max(longest.per_request, longest.per_sample)
        limit = self.unit_limit_s
        if seconds <= limit:
            return []
        profile = self.profile
        measured = (
            f"this engine's {profile.device} measured {profile.attention_flops_per_s / 1e9:.3g} GFLOP/s in attention "
            f"and {profile.other_flops_per_s / 1e9:.3g} GFLOP/s in matrix products"
        )
        what = f"{params.height}x{params.width}" + (f", {params.num_frames} frames" if params.num_frames else "")
        return [
            f"a request of {what} would run one unit of work ({name}) for about {seconds:.3g} s ({measured}), "
            f"more than the {limit:.3g} s a unit may take: a quarter of step_timeout_s={self.step_timeout_s:g} "
            "(EngineConfig.step_timeout_s; a server's --step-timeout-s), past which the engine would take the "
            f"step for hung and stop; {self._what_fits(params, encoded)}, or raise step_timeout_s"
        ]

    def _what_fits(self, params: SamplingParams, encoded: Sequence[int]) -> str:
        """The size that fits: of the input images alone where that is enough (the output kept),
        else of the output at its aspect ratio (input images scaled alike)."""
        if encoded:
            scale = self._fitting_scale(lambda scale: self.longest_units(params, encoded, input_scale=scale))
            if scale > 0:
                most = max(encoded) * scale
                side = math.floor(math.sqrt(most))
                return f"send input images of at most about {most:.0f} pixels each as encoded (about {side}x{side})"
        scale = self._fitting_scale(lambda scale: self.longest_units(params, encoded, scale, scale))
        multiple = self.spec.size_multiple
        height = math.floor(params.height * math.sqrt(scale) / multiple) * multiple
        width = math.floor(params.width * math.sqrt(scale) / multiple) * multiple
        if min(height, width) < multiple:
            return "no size fits" + (" (ask for fewer frames)" if params.num_frames else "")
        images = " (and input images scaled alike)" if encoded else ""
        return f"ask for at most about {height}x{width}{images}"

    def _fitting_scale(self, units_at) -> float:
        """The largest pixel scale in [0, 1] at which `units_at(scale)` fit (bisected; 0: none does)."""
        low, high = 0.0, 1.0
        for _ in range(50):
            middle = (low + high) / 2
            longest = units_at(middle)
            if max(longest.per_request, longest.per_sample)[0] <= self.unit_limit_s:
                low = middle
            else:
                high = middle
        return low if low > 1e-9 else 0.0
