"""Deprecated: moved to :mod:`asymcheck.integrations.support` (this alias goes in the next release)."""

from __future__ import annotations

import warnings
from typing import Any

__all__: list[str] = []

_MOVED = {"untested_version": "asymcheck.integrations.support"}


def __getattr__(name: str) -> Any:
    """The moved names, with a DeprecationWarning."""
    if name in _MOVED:
        import importlib

        warnings.warn(f"asymcheck.integration.{name} moved to {_MOVED[name]}.{name}", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
