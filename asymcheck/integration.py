"""What the framework integrations (``asymcheck.accelerate``, ``.lightning``) share: the tested-version check."""

from __future__ import annotations


def untested_version(name: str, version: str, tested: tuple[int, int]) -> str | None:
    """A refusal line when ``version`` of ``name`` is not the ``major.minor`` the tests exercise, else None."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    if (major, minor) != tested:
        return f"{name} {version}: only {tested[0]}.{tested[1]}.x is tested"
    return None
