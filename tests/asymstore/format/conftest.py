"""Fixtures of the format tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.tierkinds import Restorer


@pytest.fixture(scope="module")
def restorer() -> Iterator[Restorer]:
    """A child process that restores what the test wrote (tests/procs/restorer.py), one per test module."""
    r = Restorer()
    try:
        yield r
    finally:
        r.close()
