"""Settings: dataclass fields that carry their own one-line help.

A config dataclass (`EngineConfig`, `SamplingParams`, `RequestLimits`, the trainers' settings)
declares each field once, with `setting(default, help=...)`: its name, type, default and meaning.
Everything that shows a field reads it from there (the server's flags, the recipes' YAML keys and
`--help`), so no second copy of a field's help or default can drift from the code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a setting's value must be: `holds(value)`, and its wording in the message
    "<name> must be <wording>, got <value>"."""

    holds: Callable[[Any], bool]
    wording: str


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Any = dataclasses.MISSING,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
    one_of: tuple | None = None,
    or_none: bool = False,
    why: str = "",
    rule: Rule | None = None,
) -> Any:
    """A dataclass field with its help: what it means, its unit, its choices. Without `default` or
    `factory` the field is required. A section (a field holding a config dataclass) may go without
    help: its own fields carry it.

    What a value must be, which `setting_problems` checks: bounds (`at_least`/`above` below it,
    `at_most`/`below` above it), or `one_of` a tuple of choices, or a `rule` of its own; `or_none`
    lets None through, and `why` (what an edge value means) is added to the message."""
    metadata = {"help": help}
    if rule is None:
        rule = _bounds_rule(at_least, above, at_most, below, one_of)
    if rule is not None:
        if or_none:
            rule = Rule(lambda value, holds=rule.holds: value is None or holds(value), f"{rule.wording} or None")
        if why:
            rule = Rule(rule.holds, f"{rule.wording} ({why})")
        metadata["rule"] = rule
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata)


def _bounds_rule(at_least, above, at_most, below, one_of) -> Rule | None:
    if one_of is not None:
        return Rule(lambda value: value in one_of, f"one of {one_of}")
    lower = (">=", at_least, lambda value: value >= at_least) if at_least is not None else None
    lower = (">", above, lambda value: value > above) if above is not None else lower
    upper = ("<=", at_most, lambda value: value <= at_most) if at_most is not None else None
    upper = ("<", below, lambda value: value < below) if below is not None else upper
    if lower and upper:
        brackets = ("[" if lower[0] == ">=" else "(") + "{}, {}" + ("]" if upper[0] == "<=" else ")")
        return Rule(lambda value: lower[2](value) and upper[2](value), "in " + brackets.format(lower[1], upper[1]))
    bound = lower or upper
    return Rule(bound[2], f"{bound[0]} {bound[1]}") if bound else None


def setting_problems(settings: Any) -> list[str]:
    """What is wrong with the values of the dataclass `settings`, one message a field whose value
    breaks its `setting`'s rule, in field order."""
    problems = []
    for field in dataclasses.fields(settings):
        rule = field.metadata.get("rule")
        value = getattr(settings, field.name)
        if rule is not None and not rule.holds(value):
            shown = repr(value) if isinstance(value, str) else value
            problems.append(f"{field.name} must be {rule.wording}, got {shown}")
    return problems


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
