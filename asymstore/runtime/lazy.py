"""Lazy public names: a package lists where each name lives and imports it on first use.

Moved names (:func:`moved_getattr`) keep working for one release from their old module, with a
``DeprecationWarning`` naming where they live now.

Light tools (``python -m asymstore.fsck``) then start without importing torch
through modules they never touch.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """Return a module ``__getattr__`` for ``package`` that imports ``table[name]`` on first use and caches it."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def moved_getattr(module: str, moved: Mapping[str, tuple[str, str]],
                  fallback: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """Return a module ``__getattr__`` for ``module`` that serves its moved names with a ``DeprecationWarning``.

    Args:
        module: the old module's name (as the warning spells it).
        moved: old name -> (the module it lives in now, its name there). It is imported on each use and
            never cached, so every use warns.
        fallback: the ``__getattr__`` asked for any other name (a package's lazy names); none raises
            ``AttributeError``.
    """

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            if fallback is not None:
                return fallback(name)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, new_name = target
        warnings.warn(f"{module}.{name} is deprecated and goes in the next release: use {new_module}.{new_name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__
