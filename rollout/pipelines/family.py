"""A model family as the rest of the project sees it, declared once in its folder's family.yaml
(`rollout/pipelines/families/<folder>/family.yaml`, read by `read_folder`).

The engine's registry (`_class_name` -> adapter), the tiny pipelines' lookup by short name, the
tests' family matrix, the benchmarks' `--family` and a recipe's config check all read these
descriptors (the tuple `rollout.pipelines.families.FAMILIES`), so none of them keeps a list of its own.

A descriptor is plain data and imports neither torch nor diffusers: a recipe's config check reads
the families' facts (names, pipeline classes, accepted guidance fields) without them. The adapter,
the tiny builder and the presets are dotted paths, imported when used (`rollout.pipelines.tiny`
also derives its lookup from the descriptors, so a descriptor that imported it would import itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rollout.imports import import_by_path

# The benchmark presets every family's tiny module builds (`build_<preset>_<name>`).
PRESET_NAMES = ("small", "real")
# In each family folder: the list of its families' facts.
DECLARATIONS = "family.yaml"

if TYPE_CHECKING:
    import torch

    from rollout.pipelines.adapter import PipelineAdapter


@dataclass(frozen=True)
class Family:
    """One model family.

    name: the short name of `--family`, `model.tiny_family` and the tiny builders ("wan22").
    title: what a person calls it, for help texts ("Wan 2.2 (two experts)").
    adapter_class: "package.module.Class" of the `PipelineAdapter` subclass that runs the family's
        pipelines (`adapter` imports it).
    pipeline_class: the diffusers pipeline class (`_class_name` in model_index.json) this family
        registers; the adapter's own `pipeline_class` (a test holds them equal).
    tiny_builder: "package.module.function", `function(path, seed=0, ...) -> path`: a tiny
        pipeline of the real classes with random weights (rollout.pipelines.tiny).
    presets: benchmark preset name ("small", "real") -> "package.module.function",
        `function(folder, device="cpu", dtype=torch.float32) -> folder`: random weights at a size
        the benchmarks measure ("real": the published transformer, `real_model`).
    real_model: the published model whose transformer the "real" preset builds.
    cfg_on, cfg_off: the `SamplingParams` fields that turn classifier-free guidance on and off for
        this family (the same-named arguments of its diffusers pipeline mean the same).
    accepted_guidance_fields: the guidance fields of `SamplingParams` a model of this family may take; a
        request that sets another is refused before anything loads (a recipe's config check). A
        model's own spec may take fewer (a guidance-distilled variant takes no `guidance_scale`).
    video: whether the family makes videos (`num_frames`, outputs' `video`) rather than images.
    edits: whether its requests take input images (`images=`), as an edit pipeline's `image=`.
    attention_dispatcher: whether its denoisers' attention goes through diffusers' attention
        dispatcher, so that `EngineConfig.attention_backend` picks its kernel (SD3's processors call
        torch's attention themselves; a test holds this to the loaded processors).
    published_parts: component name -> {"params": int, "source": str}: the published parameter count
        of a component that the "real" preset builds as a stand-in (one-layer text encoders, a narrow
        VAE), and where the number comes from; the memory plan counts these (recipes/memory_plan.py).
    """

    name: str
    title: str
    adapter_class: str
    pipeline_class: str
    tiny_builder: str
    presets: Mapping[str, str]
    real_model: str
    cfg_on: Mapping[str, Any]
    cfg_off: Mapping[str, Any]
    accepted_guidance_fields: tuple[str, ...]
    video: bool = False
    edits: bool = False
    attention_dispatcher: bool = True
    published_parts: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def adapter(self) -> type[PipelineAdapter]:
        """The `PipelineAdapter` subclass that runs the family's pipelines (imports diffusers)."""
        return import_by_path(self.adapter_class, f"the {self.name} family's adapter")

    def guidance_fields(self, cfg: bool) -> dict[str, Any]:
        """The `SamplingParams` fields (and diffusers call arguments) that turn CFG on or off."""
        return dict(self.cfg_on if cfg else self.cfg_off)

    def build_tiny(self, path: str | Path, seed: int = 0, **kwargs) -> Path:
        """Build the family's tiny pipeline into `path` (see `tiny_builder`); returns `path`."""
        return import_by_path(self.tiny_builder, f"the {self.name} family's tiny builder")(path, seed=seed, **kwargs)

    def build_preset(
        self, preset: str, folder: str | Path, device: str = "cpu", dtype: torch.dtype | None = None
    ) -> Path:
        """Build the family's benchmark pipeline of `preset` into `folder` (in `dtype`; None: the
        builder's float32); returns `folder`."""
        if preset not in self.presets:
            raise ValueError(f"the {self.name} family has no preset {preset!r}; choose one of {sorted(self.presets)}")
        builder = import_by_path(self.presets[preset], f"the {self.name} family's {preset} preset")
        return builder(folder, device=device, **({} if dtype is None else {"dtype": dtype}))


def declare(
    folder: str,
    name: str,
    adapter: str,
    accepted_guidance_fields: list[str],
    builders: str | None = None,
    **facts: Any,
) -> Family:
    """The family `name` of the family folder `folder` (its package's dotted name), with the dotted
    paths that follow from the folder's layout: the adapter `<folder>.<adapter>` (adapter:
    "module.Class" inside the folder), the tiny builder `<folder>.tiny.build_tiny_<builders>` and
    the presets `<folder>.tiny.build_<preset>_<builders>` (`builders`: the name unless said).
    `facts`: the rest of `Family`'s fields, as a folder's family.yaml gives them."""
    builders = builders or name
    return Family(
        name=name,
        adapter_class=f"{folder}.{adapter}",
        tiny_builder=f"{folder}.tiny.build_tiny_{builders}",
        presets={preset: f"{folder}.tiny.build_{preset}_{builders}" for preset in PRESET_NAMES},
        accepted_guidance_fields=tuple(accepted_guidance_fields),
        **facts,
    )


def read_folder(folder: str, path: Path) -> tuple[Family, ...]:
    """The families the folder at `path` (the package `folder`) declares in its family.yaml: plain
    data, so that a descriptor is facts in one place, not a block of code each folder repeats."""
    # libyaml's loader (PyYAML builds it where libyaml is found) reads the eleven folders in ~2 ms, not ~20.
    loader = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader
    return tuple(declare(folder, **facts) for facts in yaml.load((path / DECLARATIONS).read_text(), Loader=loader))
