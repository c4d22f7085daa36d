"""A pytest plugin: a DeprecationWarning that asymcheck or asymstore issues fails the test that caused it.

pytest's ``filterwarnings`` cannot say this. A filter's module is the module a warning is *attributed*
to, and ours are attributed to their caller (``stacklevel``: the test, or the user's code), never to
``asymcheck.*``; a filter on the message would catch other libraries' deprecations as well. This
plugin looks at the frame that *issued* the warning instead: while a test runs (and while tests are
collected), ``warnings.showwarning`` raises a ``DeprecationWarning`` whose issuing frame is in
``asymcheck`` or ``asymstore``, as an ``error`` filter would. It sees only what the filters let
through, so ``pytest.warns`` / ``pytest.deprecated_call`` (which record what they catch) and an
``ignore`` filter (``@pytest.mark.filterwarnings``, ``warnings.catch_warnings``) take precedence:
a test that exercises a deprecated path on purpose wraps it in ``pytest.deprecated_call()``.

Registered by tests/conftest.py (``pytest_plugins``).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import pytest

OWN = ("asymcheck", "asymstore")
"""Top-level packages whose DeprecationWarnings are errors in the test suite."""

ROOT = Path(__file__).resolve().parents[2]

def issuer(frame: FrameType | None) -> str:
    """The module of the first frame outside :mod:`warnings` from ``frame`` outwards: the one that warned."""
    while frame is not None and frame.f_globals.get("__name__") == "warnings":
        frame = frame.f_back
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


def ours(module: str) -> bool:
    """Whether ``module`` is (in) one of the :data:`OWN` packages."""
    return module.split(".", 1)[0] in OWN


class Raiser:
    """``warnings.showwarning`` while installed: raises our DeprecationWarnings, shows every other warning."""

    def __init__(self) -> None:
        self.previous: Any = None

    def __enter__(self) -> Raiser:
        self.previous = warnings.showwarning
        warnings.showwarning = self.show
        return self

    def __exit__(self, *exc: object) -> None:
        warnings.showwarning = self.previous

    def show(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        """Raise ``message`` when asymcheck/asymstore issued it as a deprecation, else show it as before."""
        if (issubclass(category, DeprecationWarning) and ours(issuer(sys._getframe(1)))):
            raise message if isinstance(message, Warning) else category(message)
        self.previous(message, category, filename, lineno, file, line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Inside pytest's own warning capture of the test (setup, call, teardown)."""
    with Raiser():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Generator[None, object, object]:
    """Inside pytest's own warning capture of collection (a deprecated import at a module's top)."""
    with Raiser():
        return (yield)
