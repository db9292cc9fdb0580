"""Executor backends and their resolution from a name, a class or a dotted path."""

from __future__ import annotations

import importlib

from executors.base import Executor
from rollout.imports import import_by_path

# Short name -> "module:Class"; modules are imported only when selected.
_BACKENDS = {
    "uni": "executors.uni:UniExecutor",
    "mp": "executors.mp:MPExecutor",
    "ray": "executors.ray_executor:RayExecutor",
}


def get_executor_class(backend: str | type) -> type[Executor]:
    """Resolve "uni", an `Executor` subclass, or "pkg.module.MyExecutor" to an executor class.

    Raises ValueError for a name that resolves to nothing and TypeError for a class that is not
    an `Executor` subclass.
    """
    if isinstance(backend, str) and backend in _BACKENDS:
        module_name, class_name = _BACKENDS[backend].split(":")
        return getattr(importlib.import_module(module_name), class_name)
    if isinstance(backend, str):
        if "." not in backend:
            raise ValueError(
                f"unknown executor {backend!r}; use one of {sorted(_BACKENDS)}, an Executor subclass, "
                "or a dotted path 'package.module.MyExecutor'"
            )
        cls = import_by_path(backend, "executor")
    else:
        cls = backend
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise TypeError(f"executor {backend!r} is not a subclass of executors.Executor")
    return cls


__all__ = ["Executor", "get_executor_class"]
