"""What each unit of a worker's work costs as a request grows: measured once when the engine
starts, so that admission can refuse a request whose longest unit would outlast the step timeout
(`rollout.engine.work_budget`).

A unit is what advances the worker's progress count (`rollout.worker.progress`): the longest
stretch a step goes without progress is one unit, so that is what must fit in `step_timeout_s`.
`measure_work(worker)` runs a few small requests through the worker's own model runner (encode,
one denoising step, decode), at three sizes (and, for a video, at two frame counts), counting the
floating-point work each unit does (`WorkCounter`): attention apart (4 * rows * heads * q tokens *
k tokens * head dim) from the matrix products and convolutions (torch's own formulas). The work
of each unit is a polynomial of degree two in the pixels its phase sees (attention is quadratic in
tokens, everything else linear), so three sizes give it exactly, at any size. Then it times the
device on an attention of the model's smallest head dimension and on a matrix product
(`rollout.worker.work_counter.flops_per_second`), in the model's dtype. A unit's time at a size
is its attention work over the first rate plus its other work over the second: a lower bound of
sorts (elementwise work is not counted, and a machine under load runs slower), which the
admission's margin covers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rollout.input_images import InputImages
from rollout.messages import NewRequestData
from rollout.model_spec import ModelSpec
from rollout.sampling_params import SamplingParams
from rollout.worker.progress import progress_units
from rollout.worker.sent_conditions import SentConditions
from rollout.worker.work_counter import WorkCounter, attention_run, flops_per_second, matmul_run

# A phase of a request's work, and the size its units' work grows with: "encode" (texts, and input
# images at the pixels they are encoded at), "denoise" (a forward pass: the output's pixels and
# those of the input images whose tokens join it), "decode" (the output's pixels).
PHASES = ("encode", "denoise", "decode")


@dataclass(frozen=True)
class UnitWork:
    """One unit's work for one sample (one row of a forward, one image of a decode), in FLOPs, as
    `a + b * x + c * x**2` of its phase's pixels `x` times latent frames (see `WorkProfile`)."""

    name: str  # "<component>: <module path>", e.g. "vae: decoder.mid_block.attentions.0"
    phase: str  # one of PHASES
    attention: tuple[float, float, float]  # (a, b, c) of its attention's FLOPs
    other: tuple[float, float, float]  # (a, b, c) of its matrix products' and convolutions'
    # Its work per call does not grow with a video's frames (a VAE that decodes a few frames at a
    # time): it is estimated at the calibration's frames, not the request's.
    per_frame: bool = False

    def seconds(self, x: float, attention_rate: float, other_rate: float) -> float:
        return _polynomial(self.attention, x) / attention_rate + _polynomial(self.other, x) / other_rate


@dataclass(frozen=True)
class WorkProfile:
    """Every unit's work (`UnitWork`) and the device's speed, measured by `measure_work`.

    A unit's `x` is its phase's pixels (per frame) times the latent frames of the video (1 for an
    image), or times `latent_frames` (the calibration's) where it works `per_frame`."""

    units: tuple[UnitWork, ...]
    attention_flops_per_s: float  # an attention of the model's smallest head dimension
    other_flops_per_s: float  # a matrix product
    latent_frames: int  # of the calibration's requests (1 for images)
    cfg_in_one_pass: bool  # CFG's unconditional rows share the conditional rows' forward
    device: str

    def seconds(self, unit: UnitWork, pixels: float, latent_frames: int) -> float:
        """`unit`'s time for one sample whose phase sees `pixels` per frame, over `latent_frames`."""
        frames = self.latent_frames if unit.per_frame else latent_frames
        return unit.seconds(pixels * frames, self.attention_flops_per_s, self.other_flops_per_s)

    @staticmethod
    def slowest(profiles: Sequence[WorkProfile]) -> WorkProfile:
        """One profile for ranks that measured each their own: the first's units, the slowest speeds."""
        return dataclasses.replace(
            profiles[0],
            attention_flops_per_s=min(p.attention_flops_per_s for p in profiles),
            other_flops_per_s=min(p.other_flops_per_s for p in profiles),
        )


def measure_work(worker) -> WorkProfile:
    """A worker function (`collective_rpc`): this worker's `WorkProfile`. Every rank of a replica
    group runs the same requests at once, as it runs steps. The requests are the worker's own: no
    state of them is left, and the engine's bookkeeping never sees them. Compiled blocks run eager
    meanwhile (`force_eager`), so nothing compiles for these sizes."""
    adapter, runner = worker.adapter, worker.runner
    spec = adapter.spec
    names = _unit_names(adapter.components)
    counter = WorkCounter()
    recorder = UnitRecorder(counter, names)
    points = calibration_points(spec)
    work: list[dict[tuple[str, str], tuple[float, float]]] = []
    live = []  # the first request's states, whose text the others reuse (the text encoders run once)
    worker.progress.recorder = recorder
    try:
        with torch.compiler.set_stance("force_eager"), counter:
            for point in points:
                recorder.work = {}
                states = _run(runner, point.request, live, recorder)
                live = live or states
                work.append(recorder.work)
    finally:
        worker.progress.recorder = None
        adapter.forwards.take()  # these forwards are no step's
    head_dim = min(counter.head_dims, default=64)
    return WorkProfile(
        units=_fit_units(points, work),
        attention_flops_per_s=flops_per_second(attention_run(head_dim, adapter.device, adapter.dtype)),
        other_flops_per_s=flops_per_second(matmul_run(adapter.device, adapter.dtype)),
        latent_frames=points[0].latent_frames,
        cfg_in_one_pass=type(adapter).cfg_in_one_pass,
        device=str(adapter.device),
    )


def _run(runner, request: NewRequestData, live: list, recorder: UnitRecorder) -> list:
    """One small request through `runner`'s encode, one step and decode, each phase recorded."""
    recorder.begin("encode")
    states, failed = runner.prepare([request], live, 0)
    recorder.begin("denoise")
    if not failed:
        runner.step(states)
        recorder.begin("decode")
        _, failed = runner.finish(states, SentConditions())
    recorder.begin(None)
    if failed:
        raise RuntimeError(f"measuring the model's work: a small request failed: {failed[request.request_id]}")
    return states


class UnitRecorder:
    """What a worker's progress calls as each unit starts (`Progress.recorder`): charges the work
    counted since the previous unit started to that unit, in the phase that ran it, keeping the
    most any one call of it did (`work`: (phase, unit name) -> (attention, other) FLOPs)."""

    def __init__(self, counter: WorkCounter, names: dict[int, str]):
        self.counter = counter
        self.names = names
        self.work: dict[tuple[str, str], tuple[float, float]] = {}
        self._phase: str | None = None
        self._unit: str | None = None
        self._mark = (0.0, 0.0)

    def __call__(self, module: nn.Module) -> None:
        self._close()
        self._unit = self.names[id(module)]

    def begin(self, phase: str | None) -> None:
        """The work from now on is `phase`'s (None: nobody's)."""
        self._close()
        self._phase, self._unit = phase, None

    def _close(self) -> None:
        counted = (self.counter.attention, self.counter.other)
        if self._unit is not None and self._phase is not None:
            attention, other = counted[0] - self._mark[0], counted[1] - self._mark[1]
            most = self.work.get((self._phase, self._unit), (0.0, 0.0))
            self.work[(self._phase, self._unit)] = (max(most[0], attention), max(most[1], other))
        self._mark = counted


@dataclass(frozen=True)
class CalibrationPoint:
    """A small request, and the pixels each phase of it sees (per frame) and its latent frames."""

    request: NewRequestData
    pixels: dict[str, int]  # phase -> pixels
    latent_frames: int


def calibration_points(spec: ModelSpec) -> list[CalibrationPoint]:
    """Three requests of growing width (the same height and frames) and, for a video, one more
    with two latent frames more: the sizes `_fit_units` fits the work of each unit through. Three
    latent frames, not fewer: a VAE that decodes a few frames at a time (with a cache of the
    frames before) does its most per call from its third latent frame on. (Five, not four, for the
    other: the tiny Wan image-to-video pipeline fails at an even count of latent frames.)"""
    frames = 2 * spec.frame_multiple + 1 if spec.is_video else None
    points = [_point(spec, k, size, frames) for k, size in enumerate(_calibration_sizes(spec))]
    if spec.is_video:
        points.append(_point(spec, len(points), _calibration_sizes(spec)[0], 4 * spec.frame_multiple + 1))
    return points


def _calibration_sizes(spec: ModelSpec) -> list[tuple[int, int]]:
    """Three (height, width) the model takes: its first-frame sizes of three areas (a family whose
    video takes its size from its first frame), else one side of 2 size multiples (at least an
    input image's smallest side) and the other of 1, 2 and 3 times that."""
    if spec.first_frame_sizes:
        by_area = sorted(set(spec.first_frame_sizes), key=lambda size: size[0] * size[1])
        return [by_area[0], by_area[len(by_area) // 2], by_area[-1]]
    multiple = spec.size_multiple
    side = max(2 * multiple, math.ceil(spec.min_input_image_side / multiple) * multiple)
    return [(side, k * side) for k in (1, 2, 3)]


def _point(spec: ModelSpec, index: int, size: tuple[int, int], num_frames: int | None) -> CalibrationPoint:
    height, width = size
    guidance = {}
    for name, default in spec.guidance_defaults.items():
        # No classifier-free guidance (a sample is one row; the engine counts a guided one twice);
        # a distilled guidance input at its default (1 where it has none).
        guidance[name] = spec.cfg_threshold if name == spec.cfg_field else (1.0 if default is None else default)
    if spec.cfg_field is not None and spec.min_guidance_scale is not None:
        guidance[spec.cfg_field] = max(guidance[spec.cfg_field], spec.min_guidance_scale)
    params = SamplingParams(
        num_inference_steps=spec.min_inference_steps,
        height=height,
        width=width,
        num_frames=num_frames,
        seed=0,
        return_trajectory=False,
        auto_resize=False if spec.preferred_input_sizes else None,
        **guidance,
    )
    resolved, problems = spec.resolve(params)
    images = None
    if spec.max_input_images:
        # An image the family resizes to a set area first (Qwen-Image-Edit) is encoded alike at any
        # size: one size for every point, whose encoding the later points reuse (it is no cheap one).
        side, long = (height, width) if spec.encoded_image_area is None else _calibration_sizes(spec)[0]
        images = InputImages.of([torch.zeros(3, side, long, dtype=torch.uint8)])
        images = images.encoded_with(**spec.image_encoding(resolved))
        problems += spec.image_problems(images.sizes)
    if problems:
        raise RuntimeError(f"measuring the model's work: its small request is refused: {'; '.join(problems)}")
    encoded = () if images is None else spec.encoded_image_pixels(images.sizes, spec.auto_resizes(resolved))
    pixels = height * width
    request = NewRequestData(
        request_id=f"work-profile-{index}",
        # Short: text encoders that pad take their whole length anyway, and a longer text than
        # one of them takes (CLIP's 77 tokens) is truncated with a warning. A family that encodes
        # only a prompt's own tokens sees a few here: beside the image tokens of a size where a unit
        # comes near the step timeout (thousands), a long prompt's hundreds add little.
        prompt="a photo",
        params=resolved,
        init_noise_seed=0,
        step_noise_seed=0,
        images=images,
    )
    phases = {
        "encode": encoded_pixels(spec, pixels, encoded),
        "denoise": denoised_pixels(spec, pixels, encoded),
        "decode": pixels,
    }
    return CalibrationPoint(request, phases, latent_frames(spec, num_frames))


def encoded_pixels(spec: ModelSpec, pixels: int, encoded: Sequence[int]) -> int:
    """The pixels the encode phase's units grow with: the largest input image as encoded, or the
    output's where the image is a video's first frame (resized to the video's size)."""
    if spec.first_frame:
        return pixels if encoded else 0
    return max(encoded, default=0)


def denoised_pixels(spec: ModelSpec, pixels: int, encoded: Sequence[int]) -> int:
    """The pixels a forward pass sees: the output's, and the input images' whose tokens join it
    (not a first frame's, which is part of the video or extra channels)."""
    return pixels if spec.first_frame else pixels + sum(encoded)


def latent_frames(spec: ModelSpec, num_frames: int | None) -> int:
    return 1 if num_frames is None else (num_frames - 1) // spec.frame_multiple + 1


def _fit_units(points: list[CalibrationPoint], work: list[dict]) -> tuple[UnitWork, ...]:
    """Each unit's work through the calibration points of growing width that ran it (`UnitWork`;
    a text is encoded at the first only, and its encoders' units are constants), and whether it
    works per frame: the same at the video point of more frames as at the first point."""
    sized = len([point for point in points if point.latent_frames == points[0].latent_frames])
    units = []
    for key in dict.fromkeys(key for counted in work for key in counted):
        phase, name = key
        pairs = zip(points[:sized], work[:sized], strict=True)
        seen = [(point.pixels[phase] * point.latent_frames, done[key]) for point, done in pairs if key in done]
        xs = [x for x, _ in seen]
        per_frame = len(points) > sized and work[-1].get(key) == work[0].get(key)
        units.append(
            UnitWork(
                name=name,
                phase=phase,
                attention=_quadratic(xs, [attention for _, (attention, _) in seen]),
                other=_quadratic(xs, [other for _, (_, other) in seen]),
                per_frame=per_frame,
            )
        )
    return tuple(units)


def _quadratic(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """(a, b, c) of `a + b x + c x^2` through the points (of degree one less per repeated x: a
    phase whose pixels do not change, as text encoding's, is a constant)."""
    distinct = sorted(set(xs))
    degree = min(2, len(distinct) - 1)
    if degree == 0:
        return (max(ys), 0.0, 0.0)
    coefficients = np.polynomial.polynomial.polyfit(np.array(xs, dtype=np.float64), np.array(ys), degree)
    return tuple(float(c) for c in coefficients) + (0.0,) * (2 - degree)


def _polynomial(coefficients: tuple[float, float, float], x: float) -> float:
    a, b, c = coefficients
    return max(a + b * x + c * x * x, 0.0)


def _unit_names(components: dict[str, nn.Module]) -> dict[int, str]:
    """id of every progress unit of `components` -> "<component>: <module path>"."""
    names = {}
    for component, module in components.items():
        paths = {id(child): path for path, child in module.named_modules()}
        for unit in progress_units(module):
            names[id(unit)] = f"{component}: {paths[id(unit)] or type(unit).__name__}"
    return names
