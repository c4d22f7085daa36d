"""How a healthy replica group serves its committed versions, and how a recovering one reads them.

The serving side (:class:`VersionServer`) answers on a TCP socket of its own, from a thread of its own:
every request reads a *committed* version's bytes from one tier of the replica's store (its memory
tier first), on the store's loop, never from the tensors training is updating. The reading side
(:class:`ServedTier`) is a read-only tier over that socket, so a recovering replica reads the
version through the store's one read path (:func:`asymstore.read.load.load_version`): the manifest
checked and parsed, every segment's size, every chunk's checksum.

One request per connection. A request is one line of JSON (at most :data:`MAX_REQUEST_BYTES`):
``{"op": "manifest", "step": N}`` or ``{"op": "segment", "step": N, "tier": T, "name": S, "size": B}``.
The answer is one line of JSON, ``{"ok": true, "size": n, "tier": T}`` followed by exactly ``n``
bytes, or ``{"ok": false, "missing": bool, "error": "..."}``. Segments are asked of the tier that
served the manifest (each tier lays a version out in segments of its own). The reader checks every
line's size and shape and every answer's size against its request before it reads a byte of it.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from asymstore.errors import (
    AsymstoreError,
    CorruptVersionError,
    HealProtocolError,
    HealTimeoutError,
    ReadOnlyStoreError,
    TierError,
    VersionNotFoundError,
)
from asymstore.format.manifest import MAX_MANIFEST_BYTES, validate_segment_name
from asymstore.tiers.protocol import Buffer, Tier, VersionWriter

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_REQUEST_BYTES = 4096
"""Longest request line a server reads."""

MAX_ANSWER_LINE_BYTES = 8192
"""Longest answer line a reader reads."""

MAX_SEGMENT_BYTES = 1 << 40
"""Largest segment a request may name (the reader also requires the manifest's size)."""


class Runner(Protocol):
    """Runs a coroutine on the store's loop thread and returns its result (``StoreLoop.run``)."""

    def __call__(self, coro: Coroutine[Any, Any, T], /) -> T:
        """Run ``coro`` on the store's loop and wait for it."""
        ...


def _read_line(sock: socket.socket, limit: int, what: str) -> bytes:
    """One newline-terminated line of at most ``limit`` bytes (the rest of the socket is left unread)."""
    buf = bytearray()
    while True:
        b = sock.recv(1)
        if not b:
            raise HealProtocolError(f"{what}: the connection closed before the end of the line")
        if b == b"\n":
            return bytes(buf)
        buf += b
        if len(buf) > limit:
            raise HealProtocolError(f"{what}: a line longer than {limit} bytes")


def _read_exact(sock: socket.socket, out: memoryview, what: str) -> None:
    got = 0
    while got < len(out):
        n = sock.recv_into(out[got:], min(len(out) - got, 1 << 20))
        if n == 0:
            raise HealProtocolError(f"{what}: the connection closed after {got} of {len(out)} bytes")
        got += n


class VersionServer:
    """Serves the committed versions of a store's tiers to recovering replicas (a daemon thread).

    Args:
        tiers: the store's tiers, fastest first (each request takes the first that holds the version).
        run: runs a coroutine on the store's loop (tier calls happen there, as every other).
        host: the address to listen on and to advertise.
        timeout_s: every socket operation of a request.
    """

    def __init__(self, tiers: Sequence[Tier], run: Runner, *, host: str = "127.0.0.1",
                 timeout_s: float = 60.0) -> None:
        """Listen on ``host`` (a free port) and start serving."""
        self._tiers = list(tiers)
        self._run = run
        self._timeout_s = timeout_s
        self.served = 0
        """Requests answered with bytes."""
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._handle(self.request)

        self._server = socketserver.ThreadingTCPServer((host, 0), Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        self.address = f"{host}:{self._server.server_address[1]}"
        """``host:port`` a reader connects to."""
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="asymstore-torchft-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving (idempotent); requests being answered end with their connection."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(self._timeout_s)
        try:
            req = json.loads(_read_line(sock, MAX_REQUEST_BYTES, "request"))
            data, tier = self._answer(req)
        except (AsymstoreError, ValueError, TypeError, KeyError) as exc:  # a refusal the reader is told of
            self._send_error(sock, exc)
            return
        except OSError as exc:
            logger.warning("torchft serving: request failed: %s", exc)
            return
        try:
            view = memoryview(data).cast("B")
            sock.sendall(json.dumps({"ok": True, "size": len(view), "tier": tier}).encode() + b"\n")
            sock.sendall(view)
            self.served += 1
        except OSError as exc:
            logger.warning("torchft serving: the reader went away: %s", exc)

    def _send_error(self, sock: socket.socket, exc: BaseException) -> None:
        missing = isinstance(exc, VersionNotFoundError)
        if not missing:
            logger.warning("torchft serving: refused a request: %s: %s", type(exc).__name__, exc)
        try:
            line = json.dumps({"ok": False, "missing": missing, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            sock.sendall(line.encode() + b"\n")
        except OSError:
            pass

    def _answer(self, req: object) -> tuple[Buffer, str]:
        if not isinstance(req, dict) or req.get("op") not in ("manifest", "segment"):
            raise HealProtocolError(f"not a request: {str(req)[:200]}")
        step = req.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise HealProtocolError(f"not a step: {step!r}")
        if req["op"] == "manifest":
            for tier in self._tiers:
                try:
                    return self._run(tier.read_manifest(step)), tier.name
                except VersionNotFoundError:
                    continue
            raise VersionNotFoundError(f"step {step} is on none of the serving store's tiers")
        name, size, tname = req.get("name"), req.get("size"), req.get("tier")
        validate_segment_name(name)
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SEGMENT_BYTES:
            raise HealProtocolError(f"not a segment size: {size!r}")
        found = next((t for t in self._tiers if t.name == tname), None)
        if found is None:
            raise HealProtocolError(f"no tier {str(tname)[:100]!r} here")
        assert isinstance(name, str)
        return self._run(found.read_segment(step, name, size)), found.name


class ServedTier:
    """A read-only tier whose versions are those a :class:`VersionServer` serves (the recovering side).

    It lists the one step it was made for; every read is a request with its own connection, bounded
    by ``deadline`` (``time.monotonic()`` seconds): past it, :class:`~asymstore.errors.HealTimeoutError`.

    Args:
        address: the server's ``host:port``.
        step: the version to read.
        deadline: when every read must be done.
    """

    persistent = False
    keep_last: int | None = None

    def __init__(self, address: str, step: int, deadline: float) -> None:
        """Read nothing yet."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise HealProtocolError(f"not a server address: {address[:200]!r}")
        self._addr = (host.strip("[]"), int(port))
        self._step = step
        self._deadline = deadline
        self.name = f"replica@{address}"
        self.source: str | None = None
        """The serving tier's name (known once the manifest has been read)."""

    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise HealTimeoutError(f"{self.name}: the version did not arrive in time")
        return left

    def _request(self, req: dict[str, Any], size_limit: int, exact: int | None) -> tuple[bytearray, str]:
        try:
            with socket.create_connection(self._addr, timeout=self._left()) as sock:
                sock.settimeout(self._left())
                sock.sendall(json.dumps(req).encode() + b"\n")
                raw = _read_line(sock, MAX_ANSWER_LINE_BYTES, f"{self.name} answer")
                try:
                    head = json.loads(raw)
                except ValueError as exc:
                    raise HealProtocolError(f"{self.name}: an answer that is not JSON") from exc
                if not isinstance(head, dict) or not isinstance(head.get("ok"), bool):
                    raise HealProtocolError(f"{self.name}: a malformed answer {raw[:200]!r}")
                if not head["ok"]:
                    msg = f"{self.name}: {str(head.get('error'))[:2000]}"
                    if head.get("missing") is True:
                        raise VersionNotFoundError(msg)
                    raise TierError(msg)
                size, tier = head.get("size"), head.get("tier")
                if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(tier, str):
                    raise HealProtocolError(f"{self.name}: a malformed answer {raw[:200]!r}")
                if size > size_limit or (exact is not None and size != exact):
                    raise CorruptVersionError(f"{self.name}: answered {size} bytes for {req['op']} "
                                              f"{req.get('name', '')} (expected "
                                              f"{exact if exact is not None else f'at most {size_limit}'})")
                buf = bytearray(size)
                sock.settimeout(self._left())
                _read_exact(sock, memoryview(buf), f"{self.name} {req['op']}")
                return buf, tier
        except TimeoutError as exc:
            raise HealTimeoutError(f"{self.name}: no answer in time ({exc})") from exc
        except AsymstoreError:
            raise
        except OSError as exc:
            raise TierError(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    async def _call(self, req: dict[str, Any], size_limit: int, exact: int | None) -> bytearray:
        import asyncio

        data, tier = await asyncio.to_thread(self._request, req, size_limit, exact)
        if req["op"] == "manifest":
            self.source = tier
        elif tier != self.source:
            raise HealProtocolError(f"{self.name}: a segment came from {tier!r}, the manifest from {self.source!r}")
        return data

    async def open(self) -> None:
        """Nothing to open: every read connects."""

    async def close(self) -> None:
        """Nothing to close."""

    async def list_versions(self) -> list[int]:
        """The one step this tier reads."""
        return [self._step]

    async def begin(self, step: int, nbytes: int) -> VersionWriter:
        """Refused: a served version is read only."""
        raise ReadOnlyStoreError(f"{self.name} is read only")

    async def read_manifest(self, step: int) -> bytes:
        """The manifest of ``step`` as the server's fastest tier holding it has it."""
        if step != self._step:
            raise VersionNotFoundError(f"{self.name} serves step {self._step} only")
        return bytes(await self._call({"op": "manifest", "step": step}, MAX_MANIFEST_BYTES, None))

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        """Segment ``name`` of ``step`` from the tier that served the manifest (``size``: the manifest's)."""
        if self.source is None:
            raise HealProtocolError(f"{self.name}: a segment asked for before the manifest")
        if size is None:
            raise HealProtocolError(f"{self.name}: a segment's size must be known (from the manifest)")
        return await self._call({"op": "segment", "step": step, "tier": self.source, "name": name, "size": size},
                                size, size)

    async def delete_version(self, step: int) -> None:
        """Refused: read only."""
        raise ReadOnlyStoreError(f"{self.name} is read only")

    async def quarantine(self, step: int) -> None:
        """Nothing to move: the copy is the server's (a failed read is reported to the caller)."""

    async def write_latest(self, step: int) -> None:
        """Refused: read only."""
        raise ReadOnlyStoreError(f"{self.name} is read only")

    async def read_latest(self) -> int | None:
        """The one step this tier reads."""
        return self._step


_IS_TIER: type[Tier] = ServedTier
