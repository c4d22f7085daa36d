"""Fixtures for tier tests: a real S3-protocol server on loopback, and kvikio on a stub libcuda."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class S3Server:
    """A moto S3 server on 127.0.0.1 with one bucket."""

    server: object
    host: str
    port: int
    bucket: str

    def uri(self, prefix: str) -> str:
        return (f"s3://{self.bucket}/{prefix}?endpoint_override={self.host}:{self.port}&scheme=http"
                f"&access_key=test&secret_key=test&region=us-east-1")

    def stop(self) -> None:
        self.server.stop()  # type: ignore[attr-defined]

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        self.server.start()  # moto's in-process backend keeps the bucket's objects across restarts


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
    client.create_bucket(Bucket="asymstore-test")
    s3 = S3Server(server, host, port, "asymstore-test")
    try:
        yield s3
    finally:
        s3.stop()


@pytest.fixture
def s3_uri(s3_server: S3Server) -> str:
    return s3_server.uri(f"t-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="session")
def stub_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Build the stub driver and load it under its soname, so kvikio's dlopen finds it.

    On a machine with a real CUDA driver nothing is built: kvikio uses the real one.
    """
    pytest.importorskip("kvikio")
    try:
        ctypes.CDLL("libcuda.so.1")
        return "real"
    except OSError:
        pass
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stub libcuda.so.1")
    out = str(tmp_path_factory.mktemp("stubcuda") / "libcuda.so.1")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", out,
                    os.path.join(HERE, "stub_libcuda.c")], check=True)
    ctypes.CDLL(out, mode=ctypes.RTLD_GLOBAL)
    return out
