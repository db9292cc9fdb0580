"""Settings: dataclass fields that carry their own one-line help.

A config dataclass (`EngineConfig`, `SamplingParams`, `RequestLimits`, the trainers' settings)
declares each field once, with `setting(default, help=...)`: its name, type, default and meaning.
Everything that shows a field reads it from there (the server's flags, the recipes' YAML keys and
`--help`), so no second copy of a field's help or default can drift from the code.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its help: what it means, its unit, its choices. Without `default` or
    `factory` the field is required. A section (a field holding a config dataclass) may go without
    help: its own fields carry it."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help})


def setting_help(cls: type, name: str) -> str:
    """The help of field `name` of dataclass `cls`."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise ValueError(f"{cls.__name__} has no field {name!r}; its fields: {', '.join(fields)}")
    text = fields[name].metadata.get("help")
    if not text:
        raise ValueError(
            f"{cls.__name__}.{name} has no help; declare it with rollout.settings.setting(default, help=...)"
        )
    return text


def setting_default(field: dataclasses.Field) -> Any:
    """The value a field takes when none is given (a fresh one for a factory); MISSING if required."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def setting_of(cls: type, name: str) -> Any:
    """A field with the default and help of `cls`'s field `name`, for a dataclass that exposes some of
    another's settings under the same names (the recipes' engine section shows `EngineConfig`'s)."""
    setting_help(cls, name)  # names a missing field or help now, not when the help is shown
    source = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=source.default, default_factory=source.default_factory, metadata=source.metadata)
