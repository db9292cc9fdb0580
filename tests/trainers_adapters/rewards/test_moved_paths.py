"""The reward modules' old paths, which docs/training.md named before they moved into
`trainers_adapters.rewards`: for one release each still imports, with a DeprecationWarning that
names the new path and points at the import, and gives the new module's own objects."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import trainers_adapters.rewards as rewards
from trainers_adapters.rewards import builtin

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[3]
MOVED = {
    "trainers_adapters.composite_reward": "trainers_adapters.rewards.composite",
    "trainers_adapters.reward_checks": "trainers_adapters.rewards.checks",
    "trainers_adapters.reward_spec": "trainers_adapters.rewards.spec",
    "trainers_adapters.reward_runner": "trainers_adapters.rewards.runner",
    "trainers_adapters.reward_wire": "trainers_adapters.rewards.wire",
    "trainers_adapters.reward_worker_pool": "trainers_adapters.rewards.worker_pool",
    "trainers_adapters.ray_reward_pool": "trainers_adapters.rewards.ray_pool",
    "trainers_adapters.rewarded_rollout": "trainers_adapters.rewards.rewarded_rollout",
    "trainers_adapters.reward_service": "trainers_adapters.rewards.service",
    "trainers_adapters.reward_models": "trainers_adapters.rewards.models",
    "trainers_adapters.reward_models.tiny": "trainers_adapters.rewards.models.tiny",
}


def moved_warning(caught, old: str, new: str) -> warnings.WarningMessage:
    found = [w for w in caught if str(w.message).startswith(f"{old} moved to {new}:")]
    assert len(found) == 1, [str(w.message) for w in caught]
    return found[0]


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_an_old_path_warns_and_gives_the_new_modules_objects(old, new):
    sys.modules.pop(old, None)  # imported by an earlier test: its import, and warning, run again
    with pytest.warns(DeprecationWarning, match=re.escape(new)) as caught:
        __import__(old)
    assert moved_warning(caught, old, new).filename == __file__  # the line that imported the old path
    alias, module = sys.modules[old], sys.modules[new]
    public = getattr(module, "__all__", [name for name in vars(module) if not name.startswith("_")])
    assert public and all(getattr(alias, name) is getattr(module, name) for name in public)


def test_the_builtins_old_names_warn_and_are_the_builtin_modules():
    for name in ("colour_target", "get_reward", "jpeg_compressibility"):  # resolved before: warns again
        vars(rewards).pop(name, None)
    with pytest.warns(DeprecationWarning) as caught:
        from trainers_adapters.rewards import colour_target, get_reward
    old, new = "trainers_adapters.rewards.get_reward", "trainers_adapters.rewards.builtin.get_reward"
    assert moved_warning(caught, old, new).filename == __file__
    assert (get_reward, colour_target) == (builtin.get_reward, builtin.colour_target)
    with pytest.warns(DeprecationWarning, match="rewards.builtin.jpeg_compressibility"):  # a dotted path in a config
        assert builtin.get_reward("trainers_adapters.rewards.jpeg_compressibility") is builtin.jpeg_compressibility
    with pytest.raises(AttributeError, match="has no attribute 'colour_targte'"):
        rewards.colour_targte  # noqa: B018


def test_the_old_reward_service_command_still_runs():
    command = [sys.executable, "-W", "default", "-m", "trainers_adapters.reward_service", "--help"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert "usage: python -m trainers_adapters.rewards.service" in done.stdout
    assert "trainers_adapters.reward_service moved to trainers_adapters.rewards.service" in done.stderr
