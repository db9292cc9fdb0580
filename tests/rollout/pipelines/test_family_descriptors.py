"""One tuple of family descriptors, and nothing that can drift from it: every adapter module is in
it, every tiny builder builds a folder the registry maps back to the family, every family's CFG
settings turn guidance on and off on its own model, and every list of families a user reads (help
texts, YAML comments, the README) names them all."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rollout.pipelines
from benchmarks import rollout_throughput
from benchmarks.model_presets import PRESETS, VIDEO_FAMILIES
from recipes.config import ModelSection
from rollout import SamplingParams
from rollout.guidance import GUIDANCE_FIELDS
from rollout.imports import import_by_path
from rollout.pipelines import loading
from rollout.pipelines.adapter import PipelineAdapter
from rollout.pipelines.families import FAMILIES, FOLDERS, family_named, family_names
from rollout.pipelines.family import Family
from rollout.pipelines.tiny import TINY_BUILDERS
from tests.families import ALL_FAMILIES, slow_family

ROOT = Path(__file__).resolve().parents[3]
NAMES = family_names()


def _pipeline_modules():
    """Every module of rollout/pipelines, the family folders' too (the tiny package's builders
    are the families' own tiny modules); not the tiny package's `__main__`, which builds."""
    for info in pkgutil.walk_packages(rollout.pipelines.__path__, "rollout.pipelines."):
        if not info.name.endswith(".__main__"):
            yield importlib.import_module(info.name)


def test_every_adapter_is_in_the_tuple_and_every_descriptor_in_its_folder():
    adapters, descriptors = set(), []
    for module in _pipeline_modules():
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, PipelineAdapter) and not inspect.isabstract(value):
                if value.__module__ == module.__name__:
                    adapters.add(value)
            elif isinstance(value, Family):
                descriptors.append(value)
    assert adapters == {family.adapter for family in FAMILIES}
    assert descriptors == []  # declared in the folders' family.yaml only, none beside an adapter
    for family in FAMILIES:  # its adapter and builders are its folder's
        folder = family.adapter_class.rsplit(".", 2)[0]
        assert family.tiny_builder.startswith(f"{folder}.tiny.")
        # the descriptor names its adapter's pipeline class (read without importing it)
        assert family.adapter.pipeline_class == family.pipeline_class


def test_every_family_folder_is_in_the_table():
    folders = {path.parent.name for path in (ROOT / "rollout/pipelines/families").glob("*/family.yaml")}
    assert set(FOLDERS) == folders and len(FOLDERS) == len(folders)


def test_names_are_unique_and_lookups_derive_from_the_tuple():
    assert len(set(NAMES)) == len(NAMES)
    assert list(TINY_BUILDERS) == list(NAMES)
    assert rollout_throughput.FAMILIES == NAMES
    assert VIDEO_FAMILIES == tuple(family.name for family in FAMILIES if family.video)
    assert list(ALL_FAMILIES) == [f.name for f in FAMILIES if not f.video] + [f.name for f in FAMILIES if f.video]
    for name in NAMES:
        ModelSection(tiny_family=name)  # recipes take every family
    with pytest.raises(ValueError, match="unknown model family 'sdxl'; choose one of sd3, flux"):
        family_named("sdxl")


def test_the_registry_maps_every_pipeline_class_to_its_familys_adapter():
    for family in FAMILIES:
        assert loading.adapter_class(family.pipeline_class) is family.adapter
        sharing = [other for other in FAMILIES if other.pipeline_class == family.pipeline_class]
        assert {other.adapter for other in sharing} == {family.adapter}  # one class, one adapter
    assert set(loading.ADAPTERS) == {family.pipeline_class for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES, ids=NAMES)
def test_every_preset_and_tiny_builder_names_a_function(family):
    assert set(family.presets) == set(PRESETS)
    for dotted in (family.tiny_builder, *family.presets.values()):
        assert callable(import_by_path(dotted, "builder"))
    with pytest.raises(ValueError, match=f"the {family.name} family has no preset 'huge'; choose one of"):
        family.build_preset("huge", "/nonexistent")


def test_every_familys_tiny_builder_is_importable_from_the_tiny_package():
    """The docs import builders as `from rollout.pipelines.tiny import build_tiny_...`: every family's
    builder is there, handed out from its folder's tiny module."""
    import rollout.pipelines.tiny as tiny

    for family in FAMILIES:
        name = family.tiny_builder.rpartition(".")[2]
        assert getattr(tiny, name) is import_by_path(family.tiny_builder, "builder"), family.name
    with pytest.raises(AttributeError, match="has no attribute 'build_tiny_sdxl'"):
        tiny.build_tiny_sdxl  # noqa: B018


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", [pytest.param(f, marks=slow_family(f)) for f in FAMILIES], ids=NAMES)
def test_the_tiny_folder_maps_back_and_the_cfg_settings_mean_what_they_say(tiny_models, family):
    """The folder's `_class_name` loads the family's adapter; its model takes no guidance field the
    family does not declare; on its model, `cfg_on` resolves to a request with classifier-free
    guidance (a negative prompt) and `cfg_off` to one without."""
    path = tiny_models(family.name)
    index = loading.read_model_index(path)
    assert loading.adapter_class(index["_class_name"]) is family.adapter
    spec = loading.load_adapter(path).spec
    assert spec.is_video == family.video
    # What a config check refuses before loading, the model refuses too (it may refuse more).
    assert set(spec.guidance_defaults) <= set(family.accepted_guidance_fields) <= set(GUIDANCE_FIELDS)
    size = {"height": 32, "width": 32} | ({"num_frames": 9} if family.video else {})
    on, problems = spec.resolve(SamplingParams(**size, **family.cfg_on))
    if spec.cfg_field is None:  # a guidance-distilled pipeline with no CFG pass (FLUX.2 [dev]):
        # on and off are its guidance input's strength, and neither has a negative prompt
        off, problems_off = spec.resolve(SamplingParams(**size, **family.cfg_off))
        assert problems == problems_off == [] and on.negative_prompt is None is off.negative_prompt
        assert on.guidance_scale > off.guidance_scale == 1.0
        return
    assert problems == [] and on.negative_prompt is not None
    assert getattr(on, spec.cfg_field) > spec.cfg_threshold  # 1, or 0 for Z-Image
    off, problems = spec.resolve(SamplingParams(**size, **family.cfg_off))
    assert problems == [] and off.negative_prompt is None


# A line that names at least this many families is a list of them, and must name every one.
LIST_THRESHOLD = 3


def _listed_names(text: str) -> set[str]:
    return {name for name in NAMES if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text)}


def _help_texts(capsys) -> dict[str, str]:
    tiny = subprocess.run(
        [sys.executable, "-m", "rollout.pipelines.tiny", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert tiny.returncode == 0, tiny.stderr
    with pytest.raises(SystemExit):
        rollout_throughput.parse_args(["--help"])
    throughput = capsys.readouterr().out
    return {"python -m rollout.pipelines.tiny --help": tiny.stdout, "rollout_throughput --help": throughput}


@pytest.mark.timeout(120)
def test_every_shipped_list_of_families_names_them_all(capsys):
    texts = {str(path.relative_to(ROOT)): path.read_text() for path in [ROOT / "README.md", *ROOT.glob("docs/*.md")]}
    texts |= {str(path.relative_to(ROOT)): path.read_text() for path in ROOT.glob("recipes/configs/*.yaml")}
    texts |= _help_texts(capsys)
    partial = []
    for where, text in texts.items():
        # Help texts wrap their lines; a paragraph is the unit there.
        chunks = text.split("\n  -") if "--help" in where else text.splitlines()
        for chunk in chunks:
            named = _listed_names(chunk)
            if len(named) >= LIST_THRESHOLD and named != set(NAMES):
                partial.append(f"{where}: {chunk.strip()[:120]!r} lacks {sorted(set(NAMES) - named)}")
    assert partial == []
    assert all(_listed_names(text) == set(NAMES) for where, text in texts.items() if "--help" in where)


def test_the_registry_imports_no_pipeline_module():
    """The registry is imported with `rollout` (EngineConfig checks a folder's class): it must not
    import the diffusers pipelines' modules, which import transformers' image processors (seconds,
    and a torchvision notice on every process without torchvision)."""
    code = (
        "import sys; import rollout.pipelines.families, rollout.pipelines.tiny; "
        "print(sorted(m for m in sys.modules if m.startswith('diffusers.pipelines.') and '.pipeline_' in m))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert "requires torchvision" not in result.stderr
