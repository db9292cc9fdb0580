"""The engine's memory above its weights, against its family's diffusers pipeline, on the CPU.

One request (same size, frames, steps and guidance) through the engine and through the pipeline,
each measured by its allocation high-water mark above what was allocated when it began
(`benchmarks.allocation_peak`: torch's CPU allocator, as the profiler sees it; on a worker's own
thread for the engine). The engine may hold a little more (a trajectory, its step noise) but never
a multiple: Wan's decode ran with autograd on and kept every activation of its VAE for a backward
that never came (5.5x the pipeline's peak here; on an H200, 28.8 GiB against WanPipeline's 1.0).

The video families and the image families of `DEFAULT_MATRIX` run in the default suite on "uni";
Wan 2.1 on "mp" and Ray, and the other families, in the slow one (`benchmarks.rollout_throughput`
reports the same figure for each family).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.allocation_peak import AllocationPeak, engine_peak
from rollout import EngineConfig, RolloutEngine
from tests.families import ALL_FAMILIES, DEFAULT_MATRIX, VIDEO_FAMILIES

pytestmark = pytest.mark.timeout(180)

# The engine's peak above its weights may be at most this multiple of the pipeline's.
PEAK_RATIO_LIMIT = 1.2
# A short text: the text encoder's attention over 512 padded tokens (the same in both) would
# otherwise be most of either peak at these sizes and hide what the denoising and decode hold.
MAX_SEQUENCE_LENGTH = 32
EXTENSION = "benchmarks.allocation_peak.AllocationPeakExtension"
BACKENDS = {"uni": {"executor": "uni"}, "mp": {"executor": "mp", "num_workers": 1}, "ray": {"executor": "ray"}}
DEFAULT_CASES = {(name, "uni") for name in (*VIDEO_FAMILIES, *DEFAULT_MATRIX)}
CASES = [(name, "uni") for name in ALL_FAMILIES] + [("wan", "mp"), ("wan", "ray")]


def one_request(family):
    """(the engine's params, generate's inputs, the pipeline's call) for one request of `family`
    with CFG: the tiny size (a video's 9 frames), 2 steps, a trajectory recorded as RL records it."""
    # Qwen-Image 2.1's and HunyuanVideo 1.5's pipelines take no max_sequence_length (whole prompts; a fixed length).
    whole = ("qwen_image21", "hunyuan_video15", "hunyuan_video15_i2v")
    length = {} if family.name in whole else {"max_sequence_length": MAX_SEQUENCE_LENGTH}
    params = family.params(
        cfg=True, num_inference_steps=2, sampler="flow_sde", noise_level=0.7, return_trajectory=True, **length
    )
    inputs = family.inputs()
    call = {
        "prompt": "a red square",
        "height": params.height,
        "width": params.width,
        "num_inference_steps": 2,
        **length,
        "output_type": "np",
        **family.cfg,
        **family.pipeline_extra,
        **family.pipeline_inputs(inputs or None, params.height, params.width),
    }
    if family.video:
        call["num_frames"] = params.num_frames
    return params, inputs, call


def pipeline_peak(family, path: str, call: dict) -> int:
    pipeline = family.diffusers_pipeline(path)
    call = family.adapter.pipeline_arguments(pipeline, call)  # HunyuanVideo 1.5: its guider's scale
    pipeline(**call)  # the first call makes what every later call reuses
    with AllocationPeak() as peak:
        pipeline(**call)
    return peak.peak_bytes


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        pytest.param(
            name, backend, id=f"{name}-{backend}", marks=[] if (name, backend) in DEFAULT_CASES else [pytest.mark.slow]
        )
        for name, backend in CASES
    ],
)
def test_the_engine_holds_no_more_memory_than_the_pipeline(request, tiny_models, name, backend):
    family = ALL_FAMILIES[name]
    path = tiny_models(name)
    params, inputs, call = one_request(family)
    expected = pipeline_peak(family, path, call)
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    with RolloutEngine(EngineConfig(model=path, worker_extension_cls=EXTENSION, **BACKENDS[backend])) as engine:
        engine.generate(["a red square"], params, **inputs)
        outputs, (peak,) = engine_peak(engine, lambda: engine.generate(["a red square"], params, **inputs))
    media = outputs[0].video if family.video else outputs[0].image
    # The measure sees the work: the pipeline's peak is at least its decoded output in float32.
    assert expected > media.numel() * torch.float32.itemsize
    mib = 2**20
    assert peak <= PEAK_RATIO_LIMIT * expected, (
        f"{name} on {backend}: the engine's allocation peak is {peak / mib:.2f} MiB above its weights, "
        f"{peak / expected:.2f}x {family.pipeline_class}'s {expected / mib:.2f} MiB (limit {PEAK_RATIO_LIMIT}x)"
    )
