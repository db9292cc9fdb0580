"""Loading a recipe's config: its YAML, overrides and every check (`load_config`), and the recipes'
modules by name (`RECIPES`).

Apart from `recipes.config` so that nothing a recipe imports loads the recipes by name: each
recipe's module builds its `Config` on `recipes.config`'s sections.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Sequence
from pathlib import Path

from recipes.config import (
    RECIPE_NAMES,
    RecipeConfig,
    apply_overrides,
    build_section,
    format_problems,
    model_problems_of,
)
from recipes.yaml_keys import read_yaml

# Recipe name (the YAML's `recipe:`) -> module defining `Config` (a RecipeConfig) and `run(config)`.
# Modules are imported only when their recipe is used or listed.
RECIPES: dict[str, str] = {name: f"recipes.{name}" for name in RECIPE_NAMES}


def recipe_module(name: str) -> types.ModuleType:
    """The module of recipe `name`: it defines `Config` and `run(config)`."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return importlib.import_module(RECIPES[name])


def load_config(
    path: str | Path, overrides: Sequence[str] = (), *, on_this_machine: bool = False, check_fit: bool = True
) -> RecipeConfig:
    """Read the YAML at `path`, apply `overrides` ("dotted.key=yaml value"), and check everything:
    with the keys and values, what the model would refuse once loaded (`model_problems`), and with
    `on_this_machine` (as `python -m recipes.run` checks a config it is about to run) that `model.path`
    is a supported pipeline folder here and that the service at `engine.url`, if any, answers.
    `check_fit`: a training config's memory plan must fit its devices where their memory is known
    (`TrainingConfig.fit_problems`); off for `--plan`, which shows the plan that does not fit.

    Raises ValueError listing every problem found.
    """
    data = read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"invalid config {path}: the file must hold a mapping of keys, got {type(data).__name__}")
    problems = apply_overrides(data, overrides)
    name = data.get("recipe")
    if not isinstance(name, str) or name not in RECIPES:
        problems.insert(0, f"recipe: must be one of {sorted(RECIPES)}, got {name!r}")
        raise ValueError(format_problems(path, problems))
    checks = functools.partial(model_problems_of, folder_must_exist=on_this_machine)
    config = build_section(recipe_module(name).Config, data, "", problems, checks)
    if problems:
        raise ValueError(format_problems(path, problems))
    problems = config.import_problems()
    if check_fit and not problems:
        problems = config.fit_problems()
    if not problems and on_this_machine:  # a connection, once everything else is right
        problems = config.engine.service_problems()
    if problems:
        raise ValueError(format_problems(path, problems))
    return config
