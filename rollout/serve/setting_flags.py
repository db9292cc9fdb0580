"""Command-line flags made from a config dataclass's settings: `--max-batch-size` for the field
`max_batch_size`, with the field's type, default and help, so the server declares none of them again."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from rollout.settings import setting_default, setting_help

_FLAG_TYPES = (int, float, str)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_setting_flags(group: argparse._ArgumentGroup, cls: type, names: list[str]) -> None:
    """One flag per field of `cls` in `names`: required when the field has no default. A field whose
    type is a union (`int | None`, `str | type`) takes the one of int, float, str it holds."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in names:
        default = setting_default(fields[name])
        kind = flag_type(cls, name, hints[name])
        options: dict[str, Any] = {"type": kind, "help": setting_help(cls, name)}
        if kind is int:
            options["metavar"] = "N"
        if default is dataclasses.MISSING:
            options |= {"required": True, "default": argparse.SUPPRESS}  # so --help shows no default
        else:
            options["default"] = default
        group.add_argument(flag_name(name), **options)


def flag_type(cls: type, name: str, annotation: Any) -> type:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        arms = [arm for arm in typing.get_args(annotation) if arm in _FLAG_TYPES]
    else:
        arms = [annotation] if annotation in _FLAG_TYPES else []
    if len(arms) != 1:
        raise TypeError(
            f"{cls.__name__}.{name} ({annotation}) has no one flag type of int, float or str; "
            "give it a flag of its own or leave it out of the flags"
        )
    return arms[0]


def settings_from_args(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The parsed values of the flags of `names`, by field name."""
    return {name: getattr(args, name) for name in names}
