"""Rewards as plain data: what a recipe's `reward:` key names, checked without loading a model, and
built into a `CompositeReward`.

The key is one reward by name, or a mapping of component names to their settings, summed with
their weights (each component is logged as reward/<name>):

    reward: colour
    reward:
      clip_score: {weight: 1.0, model: /models/clip-vit-large-patch14}
      aesthetic: {weight: 0.5, model: /models/clip-vit-large-patch14, head: /models/laion_v2.safetensors}
      jpeg_compressibility: 0.1                # a number alone is the weight
      judge: {reward: mypkg.judges.Pairwise, device: cuda:1}   # `reward:` when the name is not the reward's

A component's reward is a built-in (`trainers_adapters.rewards.builtin`), a reward model
(`trainers_adapters.rewards.models`), `remote` (a reward service: `trainers_adapters.rewards.remote`),
or a dotted path to a reward function or class; its other
settings are the class's keyword arguments (a function takes none). A `RewardSpec` is frozen plain
data, so a reward worker process can be sent one and build the reward itself.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trainers_adapters.rewards.builtin import BUILTIN_REWARDS, Reward, get_reward
from trainers_adapters.rewards.composite import CompositeReward, RewardComponent
from trainers_adapters.rewards.models import REWARD_MODELS, ClipRewardModel
from trainers_adapters.rewards.remote import RemoteReward

RewardValue = str | dict[str, dict | float]  # the recipes' `reward:` key


@dataclass(frozen=True)
class RewardSpec:
    """One reward as data. name: the component's (metrics' reward/<name>); reward: what it is (a
    built-in, a reward model, a dotted path); weight: its factor in the sum; settings: the keyword
    arguments of its class (folders, device, batch_size, ...)."""

    name: str
    reward: str
    weight: float = 1.0
    settings: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Reward:
        target = resolve_reward(self.reward)
        if isinstance(target, type):
            return target(**self.settings)
        if self.settings:
            raise ValueError(f"{self.name}: {self.reward} is a function and takes no settings: {list(self.settings)}")
        return target

    def problems(self) -> list[str]:
        """What would stop `build`, found without loading any model."""
        problems = []
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float) or not math.isfinite(self.weight):
            problems.append(f"weight must be a finite number, got {self.weight!r}")
        try:
            target = resolve_reward(self.reward)
        except (ValueError, ImportError) as error:
            return [*problems, str(error)]
        if not isinstance(target, type):
            if self.settings:
                problems.append(f"{self.reward} is a function and takes no settings; drop {', '.join(self.settings)}")
            return problems
        problems += _argument_problems(target, self.settings)
        if issubclass(target, ClipRewardModel):
            problems += target.settings_problems(self.settings)
        return problems

    def takes_device(self) -> bool:
        """Whether the reward is a class with a `device` setting (a reward model, a user's class)."""
        target = resolve_reward(self.reward)
        return isinstance(target, type) and "device" in inspect.signature(target).parameters

    def placed_on(self, device: str) -> RewardSpec:
        """This spec with its models on `device` (a reward worker's): its `device` setting, where
        the reward takes one; a function or a class without one runs as it is."""
        if not self.takes_device():
            return self
        if "device" in self.settings:
            raise ValueError(device_conflict(self.name))
        return replace(self, settings={**self.settings, "device": device})


def device_conflict(name: str) -> str:
    return (
        f"reward.{name}.device is set, and reward_devices places every worker's models too; "
        "drop one of them (reward_devices: one device per reward worker)"
    )


def device_conflicts(value: RewardValue) -> list[str]:
    """The components of a `reward:` key that name their own device (refused with reward_devices)."""
    return [
        device_conflict(item.name)
        for item in _parse(value)
        if isinstance(item, RewardSpec) and "device" in item.settings
    ]


def _argument_problems(cls: type, settings: dict) -> list[str]:
    parameters = {name: p for name, p in inspect.signature(cls).parameters.items() if p.kind is not p.VAR_POSITIONAL}
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return []
    known = ", ".join(parameters) or "nothing"
    problems = []
    for key in settings:
        if key not in parameters:
            close = difflib.get_close_matches(key, list(parameters), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"unknown setting {key!r}; {hint}{cls.__name__} takes {known}")
    missing = [n for n, p in parameters.items() if p.default is p.empty and n not in settings]
    if missing:
        problems.append(f"{cls.__name__} needs {', '.join(missing)} (it takes {known})")
    return problems


def resolve_reward(name: str):
    """The reward function or class `name` stands for: a built-in, a reward model, or a dotted path."""
    if name in REWARD_MODELS:
        return REWARD_MODELS[name]
    if name == RemoteReward.name:
        return RemoteReward
    if name in BUILTIN_REWARDS or "." in name:
        return get_reward(name)
    raise ValueError(
        f"unknown reward {name!r}; built-ins: {sorted(BUILTIN_REWARDS)}, reward models: {sorted(REWARD_MODELS)}, "
        f"{RemoteReward.name!r} (a reward service), or a dotted path (pkg.module.name) to a reward function or class"
    )


def reward_specs(value: RewardValue) -> list[RewardSpec]:
    """The components a `reward:` key names (see the module's docstring); raises ValueError listing
    every problem."""
    problems = reward_problems(value)
    if problems:
        raise ValueError("; ".join(problems))
    return [item for item in _parse(value) if isinstance(item, RewardSpec)]


def reward_problems(value: RewardValue) -> list[str]:
    """What is wrong with a `reward:` key, every problem in the key's order, without loading a model."""
    if isinstance(value, dict) and not value:
        return ["reward is an empty mapping; name at least one reward (e.g. reward: colour)"]
    problems = []
    for item in _parse(value):
        if isinstance(item, str):
            problems.append(item)
            continue
        found = item.problems()
        if found and isinstance(value, str):
            found[-1] += f"; give them as reward: {{{value}: {{weight: 1.0, ...}}}}"
        problems += [f"reward.{item.name}: {problem}" for problem in found]
    return problems


def build_reward(value: RewardValue) -> CompositeReward:
    """The reward a `reward:` key names, its models loaded."""
    return build_specs(reward_specs(value))


def build_specs(specs: Sequence[RewardSpec]) -> CompositeReward:
    """The weighted sum of `specs`, each built (what a reward worker does with the specs it is sent)."""
    return CompositeReward([RewardComponent(s.name, s.build(), s.weight) for s in specs])


def reward_label(value: RewardValue) -> str:
    """A short text for plot titles: "colour", or "1*clip_score + 0.5*aesthetic"."""
    if isinstance(value, str):
        return value
    return " + ".join(f"{spec.weight:g}*{spec.name}" for spec in reward_specs(value))


def _parse(value: RewardValue) -> list[RewardSpec | str]:
    """The key's components in order, each a spec or, where it is malformed, the problem."""
    if isinstance(value, str):
        return [RewardSpec(name=value, reward=value)]
    items: list[RewardSpec | str] = []
    for name, settings in value.items():
        if not isinstance(name, str):
            items.append(f"reward: a component's name must be text, got {name!r}")
        elif isinstance(settings, int | float) and not isinstance(settings, bool):
            items.append(RewardSpec(name=name, reward=name, weight=float(settings)))
        elif isinstance(settings, dict):
            settings = dict(settings)
            weight = _number(settings.pop("weight", 1.0))
            reward = settings.pop("reward", name)
            if isinstance(reward, str):
                items.append(RewardSpec(name=name, reward=reward, weight=weight, settings=settings))
            else:
                items.append(f"reward.{name}.reward must name a reward, got {reward!r}")
        else:
            items.append(f"reward.{name}: expected a weight or a mapping of settings, got {settings!r}")
    return items


def _number(value):
    """`value`, or the float a text of a number stands for: YAML 1.1 (PyYAML) reads 1e-2 as text."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # reported as not a number
    return value
