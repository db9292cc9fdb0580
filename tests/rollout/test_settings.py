"""Every field of the config dataclasses declares its help once, as a `setting`, and a field
without one, or a name that is no field, is an error naming the dataclass, the field and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from rollout import EngineConfig, SamplingParams
from rollout.request_limits import RequestLimits
from rollout.settings import setting, setting_default, setting_help, setting_of
from trainers_adapters.dpo.trainer import DPOSettings
from trainers_adapters.grpo.trainer import GRPOSettings

CONFIG_DATACLASSES = [EngineConfig, SamplingParams, RequestLimits, GRPOSettings, DPOSettings]


@pytest.mark.parametrize("cls", CONFIG_DATACLASSES, ids=lambda cls: cls.__name__)
def test_every_field_has_its_help(cls):
    for f in dataclasses.fields(cls):
        text = setting_help(cls, f.name)
        assert text.strip() and "\n" not in text, f"{cls.__name__}.{f.name}: one line of help"


@pytest.mark.parametrize("cls", CONFIG_DATACLASSES, ids=lambda cls: cls.__name__)
def test_the_docstring_keeps_no_second_copy_of_the_fields_help(cls):
    """The docstring may summarise, but a per-field entry ("name: what it means") would be a copy."""
    doc = cls.__doc__ or ""
    copied = [f.name for f in dataclasses.fields(cls) if f"{f.name}:" in doc]
    assert not copied, f"{cls.__name__}'s docstring repeats the help of {copied}"


def test_a_field_without_help_or_a_missing_field_is_named():
    @dataclasses.dataclass
    class Knobs:
        speed: int = setting(3, "how fast")
        colour: str = "red"

    assert setting_help(Knobs, "speed") == "how fast"
    with pytest.raises(ValueError, match=r"Knobs.colour has no help; declare it with rollout.settings.setting"):
        setting_help(Knobs, "colour")
    with pytest.raises(ValueError, match=r"Knobs has no field 'size'; its fields: speed, colour"):
        setting_of(Knobs, "size")


def test_a_copied_setting_keeps_the_default_and_the_help():
    @dataclasses.dataclass
    class Section:
        max_batch_size: int = setting_of(EngineConfig, "max_batch_size")
        request_limits: RequestLimits = setting_of(EngineConfig, "request_limits")

    (batch, limits) = dataclasses.fields(Section)
    assert Section().max_batch_size == 16 == setting_default(batch)
    assert setting_help(Section, "max_batch_size") == setting_help(EngineConfig, "max_batch_size")
    assert setting_default(limits) == RequestLimits() and Section().request_limits is not Section().request_limits
    assert setting_default(dataclasses.fields(EngineConfig)[0]) is dataclasses.MISSING  # model is required


def test_a_settings_bounds_are_declared_with_it_and_worded_by_one_checker():
    from rollout.settings import Rule, setting_problems

    @dataclasses.dataclass
    class Knobs:
        steps: int = setting(1, "steps", at_least=1)
        share: float = setting(0.5, "share", above=0, at_most=1)
        decay: float = setting(0.5, "decay", at_least=0, below=1, why="1 freezes it")
        limit: float | None = setting(None, "limit", above=0, or_none=True)
        form: str = setting("a", "form", one_of=("a", "b"))
        indices: tuple = setting((), "indices", rule=Rule(lambda v: all(i >= 0 for i in v), "indices >= 0"))
        free: float = setting(-5.0, "no rule")

    assert setting_problems(Knobs()) == []
    wrong = Knobs(steps=0, share=0, decay=1, limit=0, form="c", indices=(-1,))
    assert setting_problems(wrong) == [
        "steps must be >= 1, got 0",
        "share must be in (0, 1], got 0",
        "decay must be in [0, 1) (1 freezes it), got 1",
        "limit must be > 0 or None, got 0",
        "form must be one of ('a', 'b'), got 'c'",
        "indices must be indices >= 0, got (-1,)",
    ]
    assert setting_problems(Knobs(share=float("nan"))) == ["share must be in (0, 1], got nan"]
