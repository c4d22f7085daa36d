"""The peer transport: a gloo process group of its own, framed messages, and waits off the event loop.

Every rank of the job builds one ``ProcessGroupGloo`` for replication, over a
prefix of the job's c10d store: never the training process group, and never a
collective — only point-to-point ``send``/``recv`` between a rank and its ring
neighbours, from the replication threads. Four tags keep the streams apart:
``REPL`` (versions, src → dst), ``ACK`` (a replica verified and published or
refused, dst → src), ``REQ`` (list / read / delete requests, src → dst) and
``RESP`` (their answers, dst → src).

A frame is one message of :data:`FRAME` bytes — magic, the JSON header's length,
the inline payload's length, the JSON, and the payload when it fits — followed,
for a larger payload (the JSON gives ``nbytes``), by messages of :data:`CHUNK`
bytes, all posted at once so that they stream. Every gloo message costs a round
trip (the receiver announces its buffer first), so a small request, answer or
segment is a single message. A receiver checks the magic and the lengths
against its own limits before it allocates anything, so a peer's bytes can
never make it read without bound.

gloo waits are blocking C++ calls: they run on daemon threads (a dead peer's
wait must never keep the process from exiting). An idle ``recv`` of gloo times
out after the group's timeout and then closes the connection, so the sending
side sends a ``ping`` frame on both request streams every ``timeout / 4``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import logging
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from asymstore.errors import PeerError, PeerProtocolError
from asymstore.tiers.base import Buffer

logger = logging.getLogger(__name__)

T = TypeVar("T")

TAG_REPL, TAG_ACK, TAG_REQ, TAG_RESP = 101, 102, 103, 104
MAGIC = 0x4153594D50454552 & 0x7FFFFFFFFFFFFFFF  # "ASYMPEER"
FRAME = 16 << 10
"""Bytes of a frame's first message: three int64 (magic, JSON length, inline payload length), the JSON, and
the payload itself when it fits; every gloo message costs a round trip, so a small frame is one message."""
_PREFIX = 24
CHUNK = 32 << 20
"""Payload bytes per gloo message when the payload does not fit in the first one."""

warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def in_thread(fn: Callable[[], T]) -> concurrent.futures.Future[T]:
    """Run ``fn`` on a new daemon thread; its result or exception lands in the returned future."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=run, name="asymstore-peer-io", daemon=True).start()
    return fut


async def blocking(fn: Callable[[], T], timeout_s: float | None = None) -> T:
    """Await ``fn()`` run on a daemon thread (at most ``timeout_s``: TimeoutError, the thread left behind)."""
    return await asyncio.wait_for(asyncio.wrap_future(in_thread(fn)), timeout_s)


def _as_tensor(buf: Buffer) -> torch.Tensor:
    view = memoryview(buf).cast("B")
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


class PeerLink:
    """Framed point-to-point messages over the replication process group.

    Args:
        pg: the replication ``ProcessGroupGloo`` (see :func:`connect`).
        rank: this rank.
        timeout_s: the group's timeout (every single wait is bounded by it).
    """

    def __init__(self, pg: Any, rank: int, timeout_s: float) -> None:
        """Wrap ``pg``."""
        self.pg = pg
        self.rank = rank
        self.timeout_s = timeout_s
        self._send_lock = threading.Lock()  # one frame at a time to any peer: frames never interleave
        self.broken: str | None = None
        """Why the link is unusable (a wait timed out or a peer hung up), or None."""

    def _check(self) -> None:
        if self.broken is not None:
            raise PeerError(f"peer link of rank {self.rank} is down: {self.broken}")

    def _fail(self, what: str, exc: BaseException) -> PeerError:
        self.broken = self.broken or f"{what}: {exc}"
        return PeerError(f"rank {self.rank}: {what}: {exc}")

    def send(self, to: int, tag: int, header: dict[str, Any], payload: Sequence[Buffer] = ()) -> None:
        """Send one frame (blocking); ``header["nbytes"]`` is set to the payload's size.

        Raises:
            PeerError: the peer is gone or the link is down.
            PeerProtocolError: the header does not fit in a frame.
        """
        self._check()
        views = [memoryview(p).cast("B") for p in payload]
        nbytes = sum(len(v) for v in views)
        body = json.dumps({**header, "nbytes": nbytes}, separators=(",", ":")).encode()
        if _PREFIX + len(body) > FRAME:
            raise PeerProtocolError(f"frame header of {len(body)} bytes does not fit in {FRAME}")
        inline = _PREFIX + len(body) + nbytes <= FRAME
        first = bytearray(FRAME)
        first[:_PREFIX] = struct.pack("<qqq", MAGIC, len(body), nbytes if inline else -1)
        first[_PREFIX:_PREFIX + len(body)] = body
        if inline:
            pos = _PREFIX + len(body)
            for v in views:
                first[pos:pos + len(v)] = v
                pos += len(v)
        with self._send_lock:
            try:
                works = [self.pg.send([_as_tensor(first)], to, tag)]
                if not inline:
                    works += [self.pg.send([_as_tensor(piece)], to, tag) for piece in _pieces(views)]
                for work in works:
                    work.wait()
            except RuntimeError as exc:
                raise self._fail(f"sending to rank {to}", exc) from exc

    def recv_header(self, frm: int, tag: int) -> tuple[dict[str, Any], bytes | None]:
        """Receive one frame's first message: its header and, when it came inline, its payload.

        A payload that did not come inline (None) must be read next with :meth:`recv_into` or :meth:`discard`.

        Raises:
            PeerError: the peer is gone, or the link is down.
            PeerProtocolError: the bytes are not a frame.
        """
        self._check()
        first = torch.empty(FRAME, dtype=torch.uint8)
        try:
            self.pg.recv([first], frm, tag).wait()
        except RuntimeError as exc:
            raise self._fail(f"receiving from rank {frm}", exc) from exc
        raw = memoryview(first.numpy().tobytes())
        magic, size, inline = struct.unpack("<qqq", raw[:_PREFIX])
        if magic != MAGIC or not 0 < size <= FRAME - _PREFIX or not -1 <= inline <= FRAME - _PREFIX - size:
            self.broken = f"rank {frm} sent a malformed frame (magic {magic:#x}, header {size} bytes)"
            raise PeerProtocolError(self.broken)
        try:
            header = json.loads(bytes(raw[_PREFIX:_PREFIX + size]))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            self.broken = f"rank {frm} sent a frame header that is not JSON"
            raise PeerProtocolError(self.broken) from exc
        if not isinstance(header, dict) or not isinstance(header.get("nbytes"), int) or header["nbytes"] < 0 \
                or inline not in (-1, header["nbytes"]):
            self.broken = f"rank {frm} sent a frame header without a consistent payload size: {str(header)[:200]}"
            raise PeerProtocolError(self.broken)
        data = bytes(raw[_PREFIX + size:_PREFIX + size + inline]) if inline >= 0 else None
        return header, data

    def exchange(self, peer: int, tag: int, header: dict[str, Any], payload: Sequence[Buffer],
                 answer_tag: int) -> tuple[dict[str, Any], bytes | None]:
        """Send a frame to ``peer`` and receive the first message of its answer (one thread hop, not two)."""
        self.send(peer, tag, header, payload)
        return self.recv_header(peer, answer_tag)

    def recv_into(self, frm: int, tag: int, out: memoryview) -> None:
        """Receive a payload of exactly ``len(out)`` bytes into ``out`` (writable), in the sender's pieces."""
        self._check()
        try:
            works = [self.pg.recv([_as_tensor(out[pos:pos + CHUNK])], frm, tag) for pos in range(0, len(out), CHUNK)]
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise self._fail(f"receiving from rank {frm}", exc) from exc

    def payload(self, frm: int, tag: int, inline: bytes | None, out: memoryview) -> None:
        """Fill ``out`` with a frame's payload: from its inline bytes, or received (see :meth:`recv_header`)."""
        if inline is not None:
            out[:] = inline
        else:
            self.recv_into(frm, tag, out)

    def discard(self, frm: int, tag: int, inline: bytes | None, nbytes: int) -> None:
        """Drop a frame's payload (one this side refuses), receiving it one piece of memory at a time."""
        if inline is not None:
            return
        scratch = memoryview(bytearray(min(nbytes, CHUNK)))
        for pos in range(0, nbytes, CHUNK):
            self.recv_into(frm, tag, scratch[:min(CHUNK, nbytes - pos)])


def _pieces(views: list[memoryview]) -> list[memoryview]:
    """The payload cut into :data:`CHUNK`-byte messages (a piece spanning parts is copied once)."""
    out: list[memoryview] = []
    bounce: bytearray | None = None
    fill = 0
    for view in views:
        pos = 0
        while pos < len(view):
            if fill == 0 and len(view) - pos >= CHUNK:  # a whole piece inside one part: no copy
                out.append(view[pos:pos + CHUNK])
                pos += CHUNK
                continue
            if bounce is None:
                bounce = bytearray(CHUNK)
            n = min(CHUNK - fill, len(view) - pos)
            bounce[fill:fill + n] = view[pos:pos + n]
            fill, pos = fill + n, pos + n
            if fill == CHUNK:
                out.append(memoryview(bounce))
                bounce, fill = None, 0
    if bounce is not None and fill:
        out.append(memoryview(bounce)[:fill])
    return out


def connect(store: Any, rank: int, world_size: int, generation: int, timeout_s: float) -> PeerLink:
    """Build this rank's end of the replication group (every rank of the job calls it; blocking).

    Args:
        store: the job's c10d store (a prefix of it is used).
        rank: this rank.
        world_size: the job's number of ranks.
        generation: distinguishes successive groups built over the same store.
        timeout_s: the group's timeout: connecting, and every single wait.
    """
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"asymstore-peer/{generation}/", store)  # type: ignore[attr-defined]
    pg = dist.ProcessGroupGloo(prefixed, rank, world_size,
                               datetime.timedelta(seconds=timeout_s))
    return PeerLink(pg, rank, timeout_s)
