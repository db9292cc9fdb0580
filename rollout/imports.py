"""Resolve "package.module.Name" strings that configs use to name user classes and functions."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable


def import_by_path(dotted: str, what: str):
    """Import the object named by `dotted` ("pkg.module.Name"); `what` names it in errors."""
    module_name, _, attribute = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"{what} {dotted!r} is not a dotted path like 'package.module.Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{what} {dotted!r}: cannot import module {module_name!r}: {error}") from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"{what} {dotted!r}: module {module_name!r} has no attribute {attribute!r}") from None


def names_moved_to(package: str, module: str) -> Callable[[str], object]:
    """The `__getattr__` of a package that stands where module `module` stood until this release
    (`rollout.weights` was one module, now `rollout.weights.state`): the old module's names still
    resolve at the package, for one release, with a DeprecationWarning naming their new module."""

    def moved_name(name: str) -> object:
        if not name.startswith("_"):
            value = getattr(importlib.import_module(module), name, _MISSING)
            if value is not _MISSING:
                message = (
                    f"{package}.{name} moved to {module}.{name}: import it from there (or from `rollout` where it "
                    f"is public); {package}.{name} goes in the next release"
                )
                warnings.warn(message, DeprecationWarning, stacklevel=2)
                return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return moved_name


_MISSING = object()


def lazy_public_names(
    package: str, table: dict[str, str], namespace: dict[str, object]
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """The `__all__` (the table's names, sorted), `__getattr__` and `__dir__` (PEP 562) of a
    package whose public names are a table of name -> module (`rollout`, `trainers_adapters`): a
    name is imported from its module on first use and kept in the package's `namespace` (its
    `globals()`), so the next lookup does not come back here, and importing the package itself
    imports none of them."""

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return sorted(table), __getattr__, __dir__
