"""A model folder's own defaults for the requests that leave them open: `sampling_defaults.json`.

A diffusers pipeline's default size is written in its `__call__` (Wan's 480 x 832 at 81 frames,
Z-Image's 1024) or read from a component's config (SD3's transformer `sample_size`). A folder
may name its own, as a transformers model carries its `generation_config.json`: the tiny
pipelines (rollout.pipelines.tiny) write 32 x 32 (videos: 9 frames), so a request that sets no
size runs on them in seconds, not minutes on a CPU; a folder without the file (a published one,
the benchmarks' real presets) keeps its pipeline's defaults. diffusers' `from_pretrained` ignores
the file; the engine reads it where it loads the folder (`PipelineAdapter.load`) and checks it
with the rest of the folder before any worker starts (`read_model_index`).

The keys are `SamplingParams` fields, each optional: `height` and `width` (an edit family that
makes an unsized edit at a pixel area with its input image's aspect ratio, as Qwen-Image-Edit,
takes height x width as that area), `num_frames` (video families), `auto_resize` (FLUX.1 Kontext).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.model_spec import ModelSpec

FILE_NAME = "sampling_defaults.json"  # beside model_index.json


@dataclass(frozen=True)
class SamplingDefaults:
    """What a folder says a request that leaves these fields unset gets (None: the pipeline's own)."""

    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    auto_resize: bool | None = None

    def write(self, folder: str | Path) -> None:
        """Write the fields that are set to `folder`'s sampling_defaults.json."""
        fields = {name: value for name, value in dataclasses.asdict(self).items() if value is not None}
        (Path(folder) / FILE_NAME).write_text(json.dumps(fields) + "\n")

    @classmethod
    def read(cls, folder: str | Path) -> SamplingDefaults:
        """The defaults `folder` names (none where it has no file); ValueError naming the file and
        what is wrong with it."""
        file = Path(folder) / FILE_NAME
        if not file.is_file():
            return cls()
        try:
            fields = json.loads(file.read_text())
        except ValueError as error:
            raise ValueError(f"{file} is not JSON ({error}); write an object such as {{'height': 64}}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"{file} holds a {type(fields).__name__}; write an object such as {{'height': 64}}")
        known = [field.name for field in dataclasses.fields(cls)]
        problems = [f"unknown key {name!r} (it takes {', '.join(known)})" for name in fields if name not in known]
        for name, value in fields.items():
            wanted = bool if name == "auto_resize" else int
            # bool is an int in Python: a size of true is refused too.
            if name in known and (type(value) is not wanted or (wanted is int and value < 1)):
                kind = "true or false" if wanted is bool else "a positive integer"
                problems.append(f"{name} must be {kind}, got {value!r}")
        if problems:
            raise ValueError(f"{file}: " + "; ".join(problems))
        return cls(**fields)

    def apply(self, spec: ModelSpec, folder: str | Path) -> ModelSpec:
        """`spec` with these defaults in place of its pipeline's; ValueError naming `folder`'s file
        where the model cannot take one of them."""
        model, problems = spec.pipeline_class, []
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and value % spec.size_multiple:
                problems.append(f"{name}={value} is not a multiple of {model}'s {spec.size_multiple} pixels")
        if self.num_frames is not None and not spec.is_video:
            problems.append(f"num_frames is for video pipelines; {model} makes images")
        elif self.num_frames is not None and (self.num_frames - 1) % spec.frame_multiple:
            problems.append(
                f"num_frames={self.num_frames} is not k * {spec.frame_multiple} + 1, as {model}'s VAE takes"
            )
        if self.auto_resize is not None and not spec.preferred_input_sizes:
            problems.append(f"auto_resize is FLUX.1 Kontext's; {model} has none")
        if problems:
            raise ValueError(f"{Path(folder) / FILE_NAME}: " + "; ".join(problems))
        height = spec.default_height if self.height is None else self.height
        width = spec.default_width if self.width is None else self.width
        sized = self.height is not None or self.width is not None
        return dataclasses.replace(
            spec,
            default_height=height,
            default_width=width,
            default_num_frames=spec.default_num_frames if self.num_frames is None else self.num_frames,
            default_auto_resize=spec.default_auto_resize if self.auto_resize is None else self.auto_resize,
            edit_area=height * width if sized and spec.edit_area is not None else spec.edit_area,
        )
