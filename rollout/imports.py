"""Resolve "package.module.Name" strings that configs use to name user classes and functions."""

from __future__ import annotations

import importlib
import warnings


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


def warn_moved(old: str, new: str) -> None:
    """Warn that module `old` moved to `new`: called by the alias module left at `old` for one release
    as it is imported, so the warning names the line that imported `old`."""
    message = f"{old} moved to {new}: import it from there ({old} goes in the next release)"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
