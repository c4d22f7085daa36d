"""The supported-settings check every framework integration makes before anything is hooked.

A framework version other than the ``major.minor`` the tests exercise is refused like a setting
(:func:`untested_version`); :func:`require_supported` raises the integration's typed error naming
every refused setting at once. The settings and their reasons: :mod:`asymcheck.integrations.settings`.
"""

from __future__ import annotations

from collections.abc import Sequence

from asymcheck.errors import UnsupportedConfigError
from asymcheck.integrations.settings import TESTED

__all__ = ["require_supported", "untested_version", "version_problems"]


def untested_version(name: str, version: str, tested: tuple[int, int]) -> str | None:
    """A refusal line when ``version`` of ``name`` is not the ``major.minor`` the tests exercise, else None."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    if (major, minor) != tested:
        return f"{name} {version}: only {tested[0]}.{tested[1]}.x is tested"
    return None


def version_problems(framework: str, version: str) -> list[str]:
    """``[line]`` when ``version`` of ``framework`` (a key of ``TESTED``) is not the tested one, else ``[]``."""
    line = untested_version(framework, version, TESTED[framework])
    return [] if line is None else [line]


def require_supported(problems: Sequence[str], error: type[UnsupportedConfigError], what: str) -> None:
    """Raise ``error`` naming every refused setting, when there is one.

    Args:
        problems: one line per refused setting (empty: supported).
        error: the integration's typed error.
        what: what does not capture the job correctly, as the message begins (``"asymcheck.accelerate.attach()
            does not capture this accelerator correctly"``).

    Raises:
        UnsupportedConfigError: ``error``, when ``problems`` is not empty.
    """
    if problems:
        raise error(f"{what}: " + "; ".join(problems))
