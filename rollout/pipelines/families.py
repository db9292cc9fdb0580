"""Every model family the project runs: one tuple of the descriptors each family's module declares.

The engine's registry (`_class_name` -> adapter), the tiny pipelines' lookup by short name, the
tests' family matrix and the benchmarks' `--family` choices are all read from `FAMILIES`; adding a
family is its module (adapter and `Family`) plus its line here.
"""

from __future__ import annotations

from rollout.pipelines import flux, flux2, flux_kontext, qwen_image, qwen_image_edit, sd3, wan, z_image
from rollout.pipelines.adapter import PipelineAdapter
from rollout.pipelines.family import Family
from rollout.pipelines.guidance import GUIDANCE_FIELDS

FAMILIES: tuple[Family, ...] = (
    sd3.FAMILY,
    flux.FAMILY,
    flux_kontext.FAMILY,
    qwen_image.FAMILY,
    qwen_image_edit.EDIT_FAMILY,
    qwen_image_edit.PLUS_FAMILY,
    flux2.FAMILY,
    wan.WAN21_FAMILY,
    wan.WAN22_FAMILY,
    z_image.FAMILY,
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
    """Diffusers pipeline class (`_class_name`) -> the adapter that runs it. Families may share a
    class (Wan 2.1 and Wan 2.2 are both `WanPipeline`), and then share its adapter."""
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
