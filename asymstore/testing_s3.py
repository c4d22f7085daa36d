"""A loopback S3 server (moto, in a child process) for users' own tests and benches of S3 remote tiers."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO

__all__ = ["LOOPBACK", "LoopbackS3", "loopback_s3"]

LOOPBACK = "127.0.0.1"
"""The only address the server listens on."""

_INSTALL_HINT = "the loopback S3 server needs moto with its server extra: pip install 'asymstore[test]'"
_REPLIES = {"stop": "stopped", "start": "started"}  # the child's answer to each command, once done


class LoopbackS3:
    """A moto S3 server in a child process, listening on 127.0.0.1 only, with one bucket.

    Made by :func:`loopback_s3`, which also ends it. The objects live in the
    child's memory: :meth:`stop` and :meth:`start` take the server off the
    network and back on the same port (an outage) without losing them.

    Attributes:
        port: The TCP port on 127.0.0.1.
        bucket: The bucket created at start.
        timeout_s: The longest wait for the child to answer a command.
    """

    def __init__(self, proc: subprocess.Popen[bytes], stderr: IO[bytes], port: int, bucket: str,
                 timeout_s: float) -> None:
        self._proc = proc
        self._stderr = stderr
        self._pending = b""
        self.port = port
        self.bucket = bucket
        self.timeout_s = timeout_s

    @property
    def host(self) -> str:
        """The address the server listens on (always ``127.0.0.1``)."""
        return LOOPBACK

    @property
    def endpoint(self) -> str:
        """The server's HTTP endpoint, e.g. for ``boto3.client("s3", endpoint_url=...)``."""
        return f"http://{LOOPBACK}:{self.port}"

    def uri(self, prefix: str) -> str:
        """An ``s3://`` URI for ``RemoteTier``: ``prefix`` in the bucket, with the endpoint and test credentials.

        Args:
            prefix: The key prefix (a directory in the bucket), without leading slash.

        Returns:
            The URI, e.g. ``s3://asymstore-test/run1?endpoint_override=127.0.0.1:PORT&scheme=http&...``.
        """
        return (f"s3://{self.bucket}/{prefix}?endpoint_override={LOOPBACK}:{self.port}&scheme=http"
                "&access_key=test&secret_key=test&region=us-east-1")

    def stop(self) -> None:
        """Take the server off the network: connections are refused until :meth:`start`; objects are kept.

        Raises:
            RuntimeError: The child did not confirm within ``timeout_s`` or has died.
        """
        self._command("stop")

    def start(self) -> None:
        """Serve again on the same port, with the objects held before :meth:`stop`.

        Raises:
            RuntimeError: The child did not confirm within ``timeout_s`` (e.g. the port was taken meanwhile)
                or has died.
        """
        self._command("start")

    def close(self) -> None:
        """End the child process (waits at most ``timeout_s``, then kills it); idempotent."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                if self._proc.stdin is not None:
                    self._proc.stdin.close()  # the child ends at end of input
            try:
                self._proc.wait(self.timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdout, self._stderr):
            if stream is not None:
                stream.close()

    def _command(self, name: str) -> None:
        stdin = self._proc.stdin
        if stdin is None or self._proc.poll() is not None:
            raise RuntimeError(f"loopback S3 server is not running{self._stderr_tail()}")
        try:
            stdin.write(f"{name}\n".encode())
            stdin.flush()
        except OSError as exc:
            raise RuntimeError(f"loopback S3 server: {name}: {exc}{self._stderr_tail()}") from exc
        reply = self._read_line(self.timeout_s)
        if reply != _REPLIES[name]:
            raise RuntimeError(f"loopback S3 server: {name}: got {reply!r}{self._stderr_tail()}")

    def _read_line(self, timeout_s: float) -> str:
        """One line of the child's protocol output, waiting at most ``timeout_s``."""
        stdout = self._proc.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"loopback S3 server did not answer in {timeout_s:g} s{self._stderr_tail()}")
            ready, _, _ = select.select([stdout], [], [], left)
            if not ready:
                continue
            chunk = os.read(stdout.fileno(), 4096)
            if not chunk:
                self._proc.wait(timeout_s)
                raise RuntimeError(f"loopback S3 server exited with status {self._proc.returncode}"
                                   f"{self._stderr_tail()}")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode(errors="replace").strip()

    def _stderr_tail(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            self._stderr.seek(0)
            tail = self._stderr.read()[-2000:].decode(errors="replace").strip()
            if tail:
                return f"; its stderr:\n{tail}"
        return ""


@contextlib.contextmanager
def loopback_s3(bucket: str = "asymstore-test", *, timeout_s: float = 60.0) -> Iterator[LoopbackS3]:
    """Run a moto S3 server on 127.0.0.1, on a free port, in a child process; create ``bucket``; end it on exit.

    The server accepts any credentials; :meth:`LoopbackS3.uri` gives
    ``RemoteTier`` URIs with test ones. Only the loopback address is used,
    and every wait is bounded by ``timeout_s``. The child ends with the
    context, or on its own when this process dies (end of its input).

    Example::

        with loopback_s3() as s3:
            store = AsymStore([LocalTier("ckpt"), RemoteTier(s3.uri("run1"))])

    Args:
        bucket: The bucket to create.
        timeout_s: The longest wait for the server to start, and for each later command.

    Yields:
        The running server.

    Raises:
        ImportError: moto (with its server extra) is not installed.
        RuntimeError: The server did not start within ``timeout_s``.
    """
    if importlib.util.find_spec("moto") is None:
        raise ImportError(_INSTALL_HINT, name="moto")
    stderr = tempfile.TemporaryFile()  # a file, not a pipe: a chatty child never blocks on it
    # Run this file as a script, not ``-m asymstore.testing_s3``: the child needs no asymstore (nor torch).
    # ``-P``: its directory (asymstore/, which holds an ``io`` package) is not put on sys.path.
    proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), bucket], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, bufsize=0)
    server = LoopbackS3(proc, stderr, 0, bucket, timeout_s)
    try:
        reply = server._read_line(timeout_s)
        word, _, rest = reply.partition(" ")
        if word == "import-error":
            raise ImportError(f"{_INSTALL_HINT} ({rest})", name="moto")
        if word != "ready":
            raise RuntimeError(f"loopback S3 server did not start: {reply!r}{server._stderr_tail()}")
        server.port = int(rest)
        yield server
    finally:
        server.close()


def _serve(bucket: str, out: IO[str]) -> int:
    """The child: serve, then obey ``stop`` / ``start`` lines on stdin until its end; protocol lines on ``out``."""
    import logging

    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        print(f"import-error {exc}", file=out, flush=True)
        return 3
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    client = boto3.client("s3", endpoint_url=f"http://{LOOPBACK}:{port}", aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    print(f"ready {port}", file=out, flush=True)
    running = True
    for line in sys.stdin:
        command = line.strip()
        if command == "stop":
            if running:
                server.stop()  # werkzeug closes the listening socket: connections are refused
                running = False
            print("stopped", file=out, flush=True)
        elif command == "start":
            if not running:  # moto's backends are module state: the objects survive the restart
                server = ThreadedMotoServer(ip_address=LOOPBACK, port=port, verbose=False)
                server.start()
                running = True
            print("started", file=out, flush=True)
        else:
            print(f"unknown {command}", file=out, flush=True)
    if running:
        server.stop()
    return 0


if __name__ == "__main__":
    _protocol = sys.stdout
    sys.stdout = sys.stderr  # anything moto prints stays out of the protocol
    sys.exit(_serve(sys.argv[1], _protocol))
