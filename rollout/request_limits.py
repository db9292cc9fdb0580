"""Upper bounds on what one request may ask for, checked at admission with the model's own rules.

The model's rules say what it can take (sizes its VAE and positional embeddings allow); these say
what this engine is willing to spend on one request, so that no client, careless or hostile, costs
the others their memory or their turn: a `num_inference_steps` of 10^7 was accepted and allocated
1.8 GB before the first step, a 0.9 MB prompt took 7.6 s of worker time to tokenise, a 10 KB PNG
decoded to 1.15 GB. Each bound has
a server flag of the same name (`--max-inference-steps`, ...), and its error names both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from rollout.model_spec import ModelSpec
from rollout.sampling_params import SamplingParams
from rollout.settings import setting

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class RequestLimits:
    """The bounds, each an integer >= 1; the server has a flag for each (`--max-inference-steps`, ...)."""

    max_inference_steps: int = setting(1000, "denoising steps of one request")
    max_branch_factor: int = setting(64, "children per branch step of a tree rollout")
    max_leaves: int = setting(1024, "outputs (leaves) per sample of a tree rollout")
    max_pixels: int = setting(
        4096 * 4096,
        "height x width of an image or of one video frame; for an edit, of the output and its input images as "
        "the model encodes them, together (every forward pass sees the tokens of both)",
    )
    max_input_images: int = setting(16, "input images (an edit family's images=) of one request, all its prompts")
    max_input_pixels: int = setting(
        4096 * 4096, "height x width of one input image as sent, checked from its header before it is decoded"
    )
    max_num_frames: int = setting(1025, "frames of a video")
    max_prompt_bytes: int = setting(
        16384,
        "UTF-8 bytes of a prompt or negative prompt (the text encoders keep at most max_sequence_length tokens, "
        "but tokenising a long text still costs its length)",
    )
    max_trajectory_bytes: int = setting(
        8 << 30,
        "bytes one sample's trajectory will hold: latents around every kept step and records, for every leaf",
    )

    def __post_init__(self) -> None:
        bad = [f.name for f in fields(self) if not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < 1]
        if bad:
            raise ValueError(f"RequestLimits: {', '.join(bad)} must be integers >= 1")

    def problems(
        self, prompt: str, params: SamplingParams, spec: ModelSpec, encoded_image_pixels: Sequence[int] = ()
    ) -> list[str]:
        """Every bound `params` (resolved against `spec`) and `prompt` exceed, each naming the bound;
        `encoded_image_pixels`: of each input image as the model encodes it (an edit's)."""
        problems = []
        steps = params.num_inference_steps
        if steps > self.max_inference_steps:
            problems.append(_over("num_inference_steps", steps, "max_inference_steps", self.max_inference_steps))
        if params.branch_steps and params.branch_factor > self.max_branch_factor:
            problems.append(_over("branch_factor", params.branch_factor, "max_branch_factor", self.max_branch_factor))
        elif params.leaves_per_sample > self.max_leaves:
            what = f"branch_factor ** len(branch_steps) = {params.leaves_per_sample} leaves per sample"
            problems.append(_over(what, None, "max_leaves", self.max_leaves))
        pixels = params.height * params.width
        encoded = sum(encoded_image_pixels)
        if pixels > self.max_pixels:
            problems.append(_over(f"height x width = {pixels} pixels", None, "max_pixels", self.max_pixels))
        elif pixels + encoded > self.max_pixels:
            # FLUX.1 Kontext's auto_resize=False encodes an image at its own size: a 4096 x 4096 one
            # beside a 32 x 32 output made a tiny model's first step run for hours.
            what = (
                f"the output's {pixels} pixels plus the {encoded} its input images are encoded at "
                "(every forward pass sees both)"
            )
            problems.append(_over(what, None, "max_pixels", self.max_pixels))
        if params.num_frames is not None and params.num_frames > self.max_num_frames:
            problems.append(_over("num_frames", params.num_frames, "max_num_frames", self.max_num_frames))
        for name, text in (("prompt", prompt), ("negative_prompt", params.negative_prompt)):
            size = len(text.encode()) if text is not None else 0
            if size > self.max_prompt_bytes:
                problems.append(_over(f"{name} ({size} bytes)", None, "max_prompt_bytes", self.max_prompt_bytes))
        if not problems:  # the estimate reads the sizes checked above
            held = trajectory_bytes(params, spec)
            if held > self.max_trajectory_bytes:
                what = f"the trajectory of one sample ({held} bytes: latents around every kept step, for every leaf)"
                problems.append(_over(what, None, "max_trajectory_bytes", self.max_trajectory_bytes))
        return problems

    def input_image_problems(self, sizes: Sequence[Sequence[tuple[int, int]]]) -> list[str]:
        """Every bound the input images of one request exceed, from their sizes alone (`sizes`: per
        prompt, the (height, width) of each image as sent), so that none is decoded first."""
        problems = []
        count = sum(len(one) for one in sizes)
        if count > self.max_input_images:
            problems.append(_over(f"{count} input images", None, "max_input_images", self.max_input_images))
        limit = self.max_input_pixels
        problems += [
            _over(f"input image {k} of prompt {p} ({h}x{w} = {h * w} pixels)", None, "max_input_pixels", limit)
            for p, one in enumerate(sizes)
            for k, (h, w) in enumerate(one)
            if h * w > limit
        ]
        return problems


def trajectory_bytes(params: SamplingParams, spec: ModelSpec) -> int:
    """What one sample's trajectory will hold at most: its kept latents and its latent-sized records
    (x0, mean), float32, for every leaf (shared prefixes counted once per leaf: an upper bound)."""
    if not params.return_trajectory:
        return 0
    latent = math.prod(spec.latent_shape(params.height, params.width, params.num_frames)) * _FLOAT32_BYTES
    steps = params.num_inference_steps
    kept = steps if params.record_steps is None else len(params.record_steps)
    entries = min(steps + 1, 2 * kept + 1)  # x_i and x_{i+1} of every kept step, and the final latents
    records = kept * sum(1 for name in params.record if name != "std")  # std is one number per step
    return latent * (entries + records) * params.leaves_per_sample


def _over(what: str, value, bound: str, limit: int) -> str:
    shown = f"{what}={value}" if value is not None else what
    return (
        f"{shown} is above this engine's limit of {limit} (RequestLimits.{bound}; a server's "
        f"--{bound.replace('_', '-')}); ask for less or raise the limit"
    )
