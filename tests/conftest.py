"""Fixtures of every test; the S3 server and stub libcuda ones come from tests/support/servers.py.

Layout: the tests mirror the source tree (tests/asymstore/write/ tests asymstore/write/, tests/asymcheck/snapshot/
tests asymcheck/snapshot/, the frameworks under tests/asymcheck/<framework>/), tests/support/ the helpers they import
(``from tests.support.x import ...``), tests/procs/ the scripts they run as child processes
(``python -m tests.procs.NAME``, see tests/support/launch.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.support.servers", "tests.support.deprecations"]

SHM = "/dev/shm"


def _is_tmpfs(path: str) -> bool:
    try:
        with open("/proc/mounts") as f:
            return any(line.split()[1:3] == [path, "tmpfs"] for line in f)
    except OSError:
        return False


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory on the /dev/shm tmpfs, removed after the test."""
    if not os.path.isdir(SHM) or not _is_tmpfs(SHM):
        pytest.skip(f"{SHM} is not a tmpfs here")
    path = tempfile.mkdtemp(prefix="asymstore-test-", dir=SHM)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def calibration_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Keep the run's tier calibrations out of ~/.cache (child processes inherit the variable)."""
    path = str(tmp_path_factory.mktemp("calibration-cache"))
    old = os.environ.get("ASYMSTORE_CACHE_DIR")
    os.environ["ASYMSTORE_CACHE_DIR"] = path
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("ASYMSTORE_CACHE_DIR", None)
        else:
            os.environ["ASYMSTORE_CACHE_DIR"] = old
