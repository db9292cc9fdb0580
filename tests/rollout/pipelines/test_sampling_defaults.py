"""A folder's own sampling defaults (`sampling_defaults.json`): the tiny folders default to tiny
sizes, a folder without the file keeps its pipeline's defaults, and a bad file is refused by name."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.loading import load_adapter
from rollout.pipelines.sampling_defaults import FILE_NAME, SamplingDefaults
from tests.families import ALL_FAMILIES, input_image, slow_family

pytestmark = pytest.mark.timeout(180)

ALL = [pytest.param(name, marks=slow_family(f)) for name, f in ALL_FAMILIES.items()]
TINY_SIDE, TINY_FRAMES = 256, 33  # the most a tiny folder's request without a size may cost
# What the families' pipelines make when a request sets no size, on a folder that names none: their
# __call__'s defaults (Wan 480 x 832 x 81, LTX-2 512 x 768 x 121, Z-Image and Qwen-Image 2.1 1024),
# or their configs' (SD3's transformer sample_size, HunyuanVideo 1.5's target_size: the tiny ones;
# FLUX.1, Qwen-Image, FLUX.2: 128 latent pixels at the tiny VAEs' scales).
PIPELINE_DEFAULTS = {
    "sd3": (32, 32, None),
    "flux": (256, 256, None),
    "flux_kontext": (256, 256, None),
    "qwen_image": (256, 256, None),
    "qwen_image21": (1024, 1024, None),
    "qwen_image_edit": (2048, 2048, None),
    "qwen_image_edit_plus": (2048, 2048, None),
    "flux2_klein": (256, 256, None),
    "flux2_dev": (256, 256, None),
    "wan": (480, 832, 81),
    "wan22": (480, 832, 81),
    "wan_i2v": (480, 832, 81),
    "wan22_i2v": (480, 832, 81),
    "ltx2": (512, 768, 121),
    "ltx2_i2v": (512, 768, 121),
    "hunyuan_video15": (24, 40, 121),
    "hunyuan_video15_i2v": (24, 40, 121),
    "zimage": (1024, 1024, None),
}


def test_every_family_is_listed():
    assert set(PIPELINE_DEFAULTS) == set(ALL_FAMILIES)


@pytest.mark.parametrize("name", ALL)
def test_a_tiny_folder_defaults_to_a_tiny_size(tiny_models, name, tmp_path):
    """Without a size a tiny folder's request is at most 256 x 256 (an edit's too, from a 32 x 32
    input, Kontext's auto_resize and the Qwen edits' megapixel included) and 33 frames; the same
    folder without its sampling_defaults.json has its pipeline's defaults, as a published folder
    and the real benchmark presets (which write none) do."""
    spec = load_adapter(tiny_models(name)).spec
    resolved, _ = spec.resolve(SamplingParams())
    assert max(resolved.height, resolved.width) <= TINY_SIDE and (resolved.num_frames or 1) <= TINY_FRAMES
    if spec.max_input_images:
        edit = spec.edit_size(((32, 32),), spec.auto_resizes(SamplingParams()))
        assert max(edit) <= TINY_SIDE, edit
    plain = shutil.copytree(tiny_models(name), tmp_path / "pipeline")
    (plain / FILE_NAME).unlink(missing_ok=True)
    own = load_adapter(plain).spec
    assert (own.default_height, own.default_width, own.default_num_frames) == PIPELINE_DEFAULTS[name]
    if name == "flux_kontext":  # resized to about a megapixel, as its pipeline's _auto_resize
        assert own.auto_resizes(SamplingParams()) and own.edit_size(((32, 32),), True) == (1024, 1024)
    if name.startswith("qwen_image_edit"):  # a megapixel at the image's aspect ratio
        assert own.edit_area == 1024 * 1024 and own.edit_size(((24, 40),)) == (800, 1312)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["wan", "zimage", "qwen_image21"])
def test_a_request_without_a_size_runs_at_the_tiny_size(tiny_models, name):
    """End to end on families whose pipelines default to 480 x 832 x 81 frames or 1024 x 1024
    (minutes of CPU on a tiny model): a request that sets no size takes seconds."""
    family = ALL_FAMILIES[name]
    params = SamplingParams(num_inference_steps=2, seed=0, **family.no_cfg)
    with RolloutEngine(EngineConfig(model=tiny_models(name))) as engine:
        start = time.perf_counter()
        (output,) = engine.generate("a red square", params)
        seconds = time.perf_counter() - start
    shape = (9, 3, 32, 32) if family.video else (3, 32, 32)
    assert tuple((output.video if family.video else output.image).shape) == shape
    assert seconds < 20, seconds


@pytest.mark.timeout(60)
def test_an_edit_without_a_size_on_tiny_kontext_is_made_at_its_input_s_size(tiny_models):
    """The tiny FLUX.1 Kontext folder turns auto_resize off by default (its pipeline's resize to
    about a megapixel is 65536 tokens through the tiny VAE); a request may still turn it on."""
    family = ALL_FAMILIES["flux_kontext"]
    with RolloutEngine(EngineConfig(model=tiny_models("flux_kontext"))) as engine:
        params = SamplingParams(num_inference_steps=2, seed=0, **family.no_cfg)
        (output,) = engine.generate("x", params, images=[[input_image(0, 24, 40)]])
        assert output.image.shape == (3, 24, 40)
        assert engine.model_spec.edit_size(((24, 40),), auto_resize=True) == (800, 1328)  # a megapixel


def test_a_bad_sampling_defaults_file_is_refused_before_any_worker_starts(tiny_models, tmp_path):
    folder = shutil.copytree(tiny_models("sd3"), tmp_path / "pipeline")
    for fields, message in [
        ({"height": 32, "steps": 4}, r"unknown key 'steps' \(it takes height, width, num_frames, auto_resize\)"),
        ({"height": "32"}, "height must be a positive integer, got '32'"),
        ({"width": True}, "width must be a positive integer, got True"),
        ({"auto_resize": 1}, "auto_resize must be true or false, got 1"),
    ]:
        (folder / FILE_NAME).write_text(json.dumps(fields))
        with pytest.raises(ValueError, match=f"{FILE_NAME}: {message}"):
            RolloutEngine(EngineConfig(model=str(folder), executor="mp"))
    (folder / FILE_NAME).write_text("[32, 32]")
    with pytest.raises(ValueError, match=f"{FILE_NAME} holds a list"):
        RolloutEngine(EngineConfig(model=str(folder)))


def test_defaults_the_model_cannot_take_are_refused_as_it_loads(tiny_models, tmp_path):
    folder = shutil.copytree(tiny_models("sd3"), tmp_path / "pipeline")
    SamplingDefaults(height=30, num_frames=9, auto_resize=False).write(folder)
    with pytest.raises(ValueError) as refused:
        load_adapter(folder)
    assert str(refused.value) == (
        f"{folder / FILE_NAME}: height=30 is not a multiple of StableDiffusion3Pipeline's 4 pixels; num_frames is "
        "for video pipelines; StableDiffusion3Pipeline makes images; auto_resize is FLUX.1 Kontext's; "
        "StableDiffusion3Pipeline has none"
    )
