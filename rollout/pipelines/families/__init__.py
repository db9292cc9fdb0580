"""Every model family the project runs: one folder each below this package, and one tuple of their
descriptors (`rollout.pipelines.family`), `FAMILIES`.

A family's folder holds its descriptors (`family.yaml`: plain data, the dotted paths derived from the
folder and the name, `rollout.pipelines.family.declare`), its adapter and its tiny builder with its
benchmark presets (`tiny.py`); several families share a folder when they share an adapter
module or a tiny builder (FLUX.1 and FLUX.1 Kontext, Wan 2.1 and 2.2). Adding a family is its folder
plus its line in `FOLDERS`. The engine's registry (`_class_name` -> adapter), the tiny pipelines'
lookup by short name, the tests' family matrix, the benchmarks' `--family` choices and a recipe's
config check are all read from `FAMILIES`. Neither this package nor a folder's `__init__` imports
torch or diffusers (the adapters are named by their dotted paths), so a config is checked against
the families without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rollout.guidance import GUIDANCE_FIELDS
from rollout.pipelines.family import Family, read_folder

if TYPE_CHECKING:
    from rollout.pipelines.adapter import PipelineAdapter

# The family folders, in the order of `--family`'s choices.
FOLDERS = (
    "sd3",
    "flux",
    "qwen_image",
    "qwen_image21",
    "qwen_image_edit",
    "flux2",
    "wan",
    "wan_i2v",
    "ltx2",
    "hunyuan_video15",
    "z_image",
)
FAMILIES: tuple[Family, ...] = tuple(
    family for folder in FOLDERS for family in read_folder(f"{__name__}.{folder}", Path(__file__).parent / folder)
)


def family_names() -> tuple[str, ...]:
    """The short names, in `FAMILIES` order (what `--family` and `model.tiny_family` take)."""
    return tuple(family.name for family in FAMILIES)


def family_named(name: str) -> Family:
    """The family of short name `name`; ValueError naming the known ones otherwise."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(family_names())}")


def adapters_by_pipeline() -> dict[str, type[PipelineAdapter]]:
    """Diffusers pipeline class (`_class_name`) -> the adapter that runs it (imported). Families may
    share a class (Wan 2.1 and Wan 2.2 are both `WanPipeline`), and then share its adapter."""
    return {family.pipeline_class: family.adapter for family in FAMILIES}


def families_help() -> str:
    """One line per family for `--help` texts: "name: PipelineClass (title)"."""
    return "; ".join(f"{family.name}: {family.pipeline_class} ({family.title})" for family in FAMILIES)


def edit_families_help() -> str:
    """The families that take input images, for errors: "name (PipelineClass), ..."."""
    edits = [family for family in FAMILIES if family.edits]
    return ", ".join(f"{family.name} ({family.pipeline_class})" for family in edits) or "none"


def request_field_problems(families: tuple[Family, ...], params) -> list[str]:
    """The fields of `params` (a `SamplingParams`) that no model of `families` takes (the families
    of one pipeline class; Wan 2.1 and 2.2 share theirs), in the engine's words. Known before any
    model loads; the loaded model's spec refuses more (a distilled variant takes fewer fields)."""
    model = families[0].pipeline_class
    taken = sorted({name for family in families for name in family.accepted_guidance_fields})
    problems = [
        f"{name} is not used by {model}; leave it unset ({model} takes {', '.join(taken)})"
        for name in GUIDANCE_FIELDS
        if getattr(params, name) is not None and name not in taken
    ]
    if params.num_frames is not None and not any(family.video for family in families):
        problems.append(f"num_frames is for video pipelines; {model} makes images, so leave num_frames unset")
    return problems


def families_of(pipeline_class: str) -> tuple[Family, ...]:
    """The families that register `pipeline_class` (a model_index.json's `_class_name`)."""
    return tuple(family for family in FAMILIES if family.pipeline_class == pipeline_class)
