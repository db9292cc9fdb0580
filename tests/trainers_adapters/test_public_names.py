"""`trainers_adapters`' flat table of public names: each is the object of the module the table
names, and the table loads nothing until a name is asked for (a recipe's config check brings no torch)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

import trainers_adapters


def test_each_public_name_is_the_object_where_it_lives():
    for name in trainers_adapters.__all__:
        module = trainers_adapters.PUBLIC_NAMES[name]
        value = getattr(trainers_adapters, name)
        assert value is getattr(importlib.import_module(module), name), name
        if inspect.isclass(value) or inspect.isfunction(value):  # not `Reward`, a type alias
            assert (value.__name__, value.__module__) == (name, module)
    with pytest.raises(AttributeError, match="no attribute 'GRPOTrainer'"):
        trainers_adapters.GRPOTrainer  # noqa: B018


def test_importing_the_package_and_the_settings_loads_no_torch():
    script = (
        "import sys, trainers_adapters\n"
        "from trainers_adapters import DPOSettings, GRPOSettings, NFTSettings\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'diffusers', 'peft'}))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
