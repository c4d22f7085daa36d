"""Fixtures for tier tests: a real S3-protocol server on loopback, and kvikio on a stub libcuda.

Registered for every test by tests/conftest.py (``pytest_plugins``): a test asks for ``s3_server``,
``s3_uri`` or ``stub_libcuda`` by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from asymstore.testing_s3 import LoopbackS3, loopback_s3

STUB_LIBCUDA = Path(__file__).resolve().with_name("stub_libcuda.c")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LoopbackS3]:
    """A moto S3 server on 127.0.0.1 (a child process) with the bucket ``asymstore-test``; skipped without moto."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(loopback_s3("asymstore-test"))
        except ImportError as exc:
            pytest.skip(str(exc))
        yield server


@pytest.fixture
def s3_uri(s3_server: LoopbackS3) -> str:
    """A fresh prefix of the test bucket, as a RemoteTier URI."""
    return s3_server.uri(f"t-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="session")
def stub_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Build the stub driver and load it under its soname, so kvikio's dlopen finds it.

    On a machine with a real CUDA driver nothing is built: kvikio uses the real one. Without kvikio the
    test is skipped with the reason; where it is installed (``make setup`` installs kvikio-cu12) but does
    not import, the test fails: the engine must never be skipped silently there.
    """
    if importlib.util.find_spec("kvikio") is None:
        pytest.skip("kvikio is not installed (make setup installs kvikio-cu12)")
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # installed but broken: a failure, not a skip
        pytest.fail(f"kvikio is installed but does not import: {exc!r}")
    try:
        ctypes.CDLL("libcuda.so.1")
        return "real"
    except OSError:
        pass
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stub libcuda.so.1")
    out = str(tmp_path_factory.mktemp("stubcuda") / "libcuda.so.1")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", out, str(STUB_LIBCUDA)],
                   check=True)
    ctypes.CDLL(out, mode=ctypes.RTLD_GLOBAL)
    return out
