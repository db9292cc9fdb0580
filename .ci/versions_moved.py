"""What moved between the pinned versions and this environment: `python .ci/versions_moved.py PINS`.

Run by `make test-latest` in its venv of the newest releases, before the suite, so a failure there
comes with the list of packages that changed under it.
"""

from __future__ import annotations

import sys
from importlib.metadata import distributions
from pathlib import Path

from packaging.utils import canonicalize_name

# Never in the pins: pip's own tools, torch (the Makefile's TORCH_SPEC) and this project.
UNPINNED = {"pip", "setuptools", "wheel", "torch", "diffusion-rollout"}


def pinned(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    return pins


def main(pins_file: str) -> None:
    pins = pinned(Path(pins_file))
    here = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}
    both = sorted(pins.keys() & here.keys())
    moved = [f"{name}: {pins[name]} -> {here[name]}" for name in both if pins[name] != here[name]]
    new = [f"{name}: {here[name]} (not pinned)" for name in sorted(here.keys() - pins.keys() - UNPINNED)]
    gone = [f"{name}: {pins[name]} (no longer installed)" for name in sorted(pins.keys() - here.keys())]
    print(f"torch {here.get('torch', 'not installed')} (TORCH_SPEC)")
    print(f"versions moved from {pins_file}: {len(moved)} changed, {len(new)} new, {len(gone)} gone")
    for line in moved + new + gone:
        print("  " + line)


if __name__ == "__main__":
    main(sys.argv[1])
