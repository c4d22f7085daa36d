"""The peer transport: a gloo process group of its own, framed messages, and waits off the event loop.

Every rank builds one ``ProcessGroupGloo`` for replication over a prefix of the job's c10d store
(never the training group, never a collective): point-to-point ``send``/``recv`` between ring
neighbours from the replication threads, on four tags (``REPL``, ``ACK``, ``REQ``, ``RESP``). A
frame is one message of :data:`FRAME` bytes (magic, lengths, JSON header, a small payload inline)
followed by messages of at most :data:`CHUNK` bytes posted at once; a receiver checks every length
against its limits before it allocates. In a ring of two nodes a second group (``lanes``) gives each
rank's own flow a connection of its own; a reader posts the next frame's first receive early
(:meth:`PeerLink.reading_ahead`, :meth:`PeerLink.post_header`). gloo waits run on daemon threads,
idle streams are pinged every ``timeout / 4``, and :meth:`PeerLink.end` (on close and at interpreter
exit) refuses new operations, then lets a 1 ms receive from each peer time out (which fails every
wait pending on the group) until no thread is inside gloo: one there at finalization is a SIGABRT.

The transport, its limits and its failures: docs/guides/multirank.md.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import datetime
import json
import logging
import struct
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from asymstore.errors import PeerError, PeerProtocolError
from asymstore.runtime.daemons import DaemonWorkers
from asymstore.runtime.exiting import EXIT_WAIT_S, at_exit, cancel
from asymstore.tiers.protocol import Buffer

logger = logging.getLogger(__name__)

T = TypeVar("T")

TAG_REPL, TAG_ACK, TAG_REQ, TAG_RESP = 101, 102, 103, 104
TAG_POKE = 105
"""Never sent: :meth:`PeerLink.end` waits for it, briefly, to fail the group's pending operations."""
MAGIC = 0x4153594D50454552 & 0x7FFFFFFFFFFFFFFF  # "ASYMPEER"
FRAME = 16 << 10
"""Bytes of a frame's first message: three int64 (magic, JSON length, inline payload length), the JSON, and
the payload itself when it fits; every gloo message costs a round trip, so a small frame is one message."""
_PREFIX = 24
CHUNK = 32 << 20
"""Payload bytes per gloo message at most, when the payload does not fit in the first one."""
DIRECT = 1 << 20
"""Payload parts at least this large are sent from their own memory; smaller ones are gathered into a copy."""
MAX_PIECES = 1024
"""Payload messages a frame lists (``pieces``); a payload of more is cut into CHUNK-sized copies instead."""

warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_STUCK: list[Any] = []
"""Groups a thread may still be blocked in (:meth:`PeerLink.end` could not fail its wait): never destroyed."""


_WORKERS = DaemonWorkers("asymstore-peer-io")
"""The daemon threads blocking link calls run on (a call stuck in gloo keeps its thread, never the exit)."""


def in_thread(fn: Callable[[], T]) -> concurrent.futures.Future[T]:
    """Run ``fn`` on a daemon thread (an idle one reused); its result or exception lands in the returned future."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():  # cancelled before it started
            return
        try:  # once running, the future cannot be cancelled: its outcome is always set, never raised here
            result = fn()
        except BaseException as exc:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    _WORKERS.submit(run)
    return fut


async def blocking(fn: Callable[[], T], timeout_s: float | None = None) -> T:
    """Await ``fn()`` run on a daemon thread (at most ``timeout_s``: TimeoutError, the thread left behind)."""
    return await asyncio.wait_for(asyncio.wrap_future(in_thread(fn)), timeout_s)


def _as_tensor(buf: Buffer) -> torch.Tensor:
    view = memoryview(buf).cast("B")
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


class PeerLink:
    """Framed point-to-point messages over the replication process groups.

    Args:
        pg: the replication ``ProcessGroupGloo`` (see :func:`connect`), or one per lane.
        rank: this rank.
        timeout_s: the groups' timeout (every single wait is bounded by it).
        lanes: the group (index into ``pg``) of each rank's own flow (its ``REPL`` and ``REQ`` out,
            their ``ACK`` and ``RESP`` back); None: every flow on the one group.
    """

    def __init__(self, pg: Any, rank: int, timeout_s: float, lanes: Sequence[int] | None = None) -> None:
        """Wrap ``pg``."""
        self.groups: tuple[Any, ...] = tuple(pg) if isinstance(pg, (list, tuple)) else (pg,)
        self.pg = self.groups[0]
        if lanes is not None and not all(0 <= lane < len(self.groups) for lane in lanes):
            raise ValueError(f"lanes {list(lanes)[:8]} name groups beyond the {len(self.groups)} given")
        self._lanes = tuple(lanes) if lanes is not None else None
        self._posted: dict[tuple[int, int], collections.deque[tuple[torch.Tensor, Any]]] = {}
        """First messages of frames received ahead (:meth:`post_header`), per (peer, tag), in the order posted."""
        self._armed: set[tuple[int, int]] = set()
        self.rank = rank
        self.timeout_s = timeout_s
        self._send_locks: dict[tuple[int, int], threading.Lock] = {}
        """One frame at a time per (peer, tag) stream, so that a stream's frames never interleave. Not one lock
        for the link: a gloo send waits until the receiver posts its receive, and a request waiting for a busy
        neighbour must not hold up this rank's answers to it (the two directions of a restore overlap)."""
        self.broken: str | None = None
        self._violated = False  # broken by a peer's malformed or unexpected frame (not by a failed transport)
        """Why the link is unusable (a wait timed out or a peer hung up), or None."""
        self._cond = threading.Condition()
        self._inflight = 0  # threads inside a gloo call of this group
        self._peers: set[int] = set()  # every rank this link exchanged messages with
        self._ended: str | None = None
        self._exit_handle: int | None = at_exit(self._at_exit, phase=1)

    @contextlib.contextmanager
    def _io(self, peer: int) -> Iterator[None]:
        """Around every gloo call: counted, so that :meth:`end` knows when none is left; refused once ended."""
        with self._cond:
            if self._ended is not None:
                raise PeerError(f"peer link of rank {self.rank} is down: {self._ended}")
            self._inflight += 1
            self._peers.add(peer)
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def group(self, peer: int, tag: int, sending: bool) -> Any:
        """The group a message to (``sending``) or from ``peer`` with ``tag`` travels on: its flow's lane."""
        if self._lanes is None:
            return self.groups[0]
        source = self.rank if (tag in (TAG_REPL, TAG_REQ)) == sending else peer
        return self.groups[self._lanes[source]]

    def post_header(self, frm: int, tag: int) -> None:
        """Post the receive of the next frame's first message from ``frm`` now (the caller knows one follows).

        :meth:`recv_header` takes it, in the order posted. Only after every receive of the frame before it
        is posted: gloo matches a stream's messages to its receives in the order they were posted.
        """
        first = torch.empty(FRAME, dtype=torch.uint8)
        with self._cond:
            if self._ended is not None or self.broken is not None:
                return  # nothing more is read on this link
            try:
                work = self.group(frm, tag, False).recv([first], frm, tag)
            except RuntimeError as exc:
                raise self._fail(f"receiving from rank {frm}", exc) from exc
            self._posted.setdefault((frm, tag), collections.deque()).append((first, work))
            self._peers.add(frm)

    @contextlib.contextmanager
    def reading_ahead(self, frm: int, tag: int, enabled: bool = True) -> Iterator[None]:
        """Within it, the frame being read is followed by another: its first receive is posted early.

        Posted as soon as the current frame's payload receives are (:meth:`scatter`, :meth:`discard`), else
        when the block ends without an error (an inline frame); never after an error (the link is down,
        or the frame was refused and the caller stops).
        """
        if not enabled:
            yield
            return
        with self._cond:
            self._armed.add((frm, tag))
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._cond:
                still = (frm, tag) in self._armed
                self._armed.discard((frm, tag))
            if still and ok:
                self.post_header(frm, tag)

    def _payload_posted(self, frm: int, tag: int) -> None:
        """Every receive of the current frame's payload is posted: post the next frame's first one, if armed."""
        with self._cond:
            if (frm, tag) not in self._armed:
                return
            self._armed.discard((frm, tag))
        self.post_header(frm, tag)

    def _drain_posted(self) -> None:
        """Wait 1 ms on each receive posted ahead that nobody took: the timeout fails the group's waits."""
        with self._cond:
            posted = [item for queue in self._posted.values() for item in queue]
            self._posted.clear()
        for _, work in posted:
            try:
                work.wait(datetime.timedelta(milliseconds=1))
            except RuntimeError:
                pass

    def end(self, why: str, grace_s: float = 0.0, timeout_s: float = EXIT_WAIT_S) -> bool:
        """Refuse new gloo operations, and fail those still in flight after ``grace_s`` (blocking).

        A receive from each peer with a tag nobody sends, waited 1 ms, times out, and a gloo timeout
        closes every connection of the group and fails every pending operation: the threads blocked in
        one come back with an error (nothing else can interrupt a gloo wait). Receives posted ahead
        that no reader took are failed the same way.

        Returns:
            True when no thread is left inside gloo (within ``timeout_s``): the group can be dropped.
            Otherwise the group is kept alive until the process ends (never destroyed under a thread).
        """
        with self._cond:
            self._ended = self._ended or why
            self.broken = self.broken or why
            self._cond.wait_for(lambda: self._inflight == 0, grace_s)
            peers = sorted(self._peers)
        self._drain_posted()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                if self._inflight == 0:
                    cancel(self._exit_handle)
                    self._exit_handle = None
                    return True
            if time.monotonic() > deadline:
                break
            for pg in self.groups:
                for peer in peers:
                    try:
                        pg.recv([torch.empty(1, dtype=torch.uint8)], peer, TAG_POKE).wait(
                            datetime.timedelta(milliseconds=1))
                    except RuntimeError:
                        pass  # the timeout (or the connection to a dead peer, already failed)
            with self._cond:
                self._cond.wait_for(lambda: self._inflight == 0, 0.05)
        logger.warning("peer link of rank %d: %d gloo wait(s) still blocked %.0f s after ending it (%s); "
                       "the group is kept until the process ends", self.rank, self._inflight, timeout_s, why)
        _STUCK.append(self.groups)
        return False

    def _at_exit(self) -> None:
        self.end("the process is exiting")

    def violated(self, why: str) -> PeerProtocolError:
        """Mark the link down by a protocol violation (the first reason kept); return the error to raise.

        Every later call on the link then raises :class:`PeerProtocolError` too, so requests in flight
        beside the one that met the violation report the same kind of failure, whichever ends first.
        """
        self.broken = self.broken or why
        self._violated = True
        return PeerProtocolError(why)

    def _check(self) -> None:
        if self.broken is not None:
            kind = PeerProtocolError if self._violated else PeerError
            raise kind(f"peer link of rank {self.rank} is down: {self.broken}")

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
        pieces = [] if inline else _pieces(views)
        if not inline and len(pieces) <= MAX_PIECES:  # the receiver posts one receive per piece, where it lands
            body = json.dumps({**header, "nbytes": nbytes, "pieces": [len(p) for p in pieces]},
                              separators=(",", ":")).encode()
        if not inline and (len(pieces) > MAX_PIECES or _PREFIX + len(body) > FRAME):
            pieces = _cut(views)  # many small parts: copied into CHUNK-sized messages
            body = json.dumps({**header, "nbytes": nbytes}, separators=(",", ":")).encode()
        first[:_PREFIX] = struct.pack("<qqq", MAGIC, len(body), nbytes if inline else -1)
        first[_PREFIX:_PREFIX + len(body)] = body
        if inline:
            pos = _PREFIX + len(body)
            for v in views:
                first[pos:pos + len(v)] = v
                pos += len(v)
        with self._cond:
            lock = self._send_locks.setdefault((to, tag), threading.Lock())
        with lock, self._io(to):
            try:
                pg = self.group(to, tag, True)
                works = [pg.send([_as_tensor(first)], to, tag)]
                works += [pg.send([_as_tensor(piece)], to, tag) for piece in pieces]
                for work in works:
                    work.wait()
            except RuntimeError as exc:
                raise self._fail(f"sending to rank {to}", exc) from exc

    def recv_header(self, frm: int, tag: int) -> tuple[dict[str, Any], bytes | None]:
        """Receive one frame's first message: its header and, when it came inline, its payload.

        A payload that did not come inline (None) must be read next: :meth:`payload`, :meth:`scatter`, :meth:`discard`.

        Raises:
            PeerError: the peer is gone, or the link is down.
            PeerProtocolError: the bytes are not a frame.
        """
        self._check()
        try:
            with self._io(frm):  # taken inside it: a receive posted ahead is either waited here, or drained by end()
                with self._cond:
                    queue = self._posted.get((frm, tag))
                    ahead = queue.popleft() if queue else None
                if ahead is None:
                    first = torch.empty(FRAME, dtype=torch.uint8)
                    self.group(frm, tag, False).recv([first], frm, tag).wait()
                else:
                    first, work = ahead
                    work.wait()
        except RuntimeError as exc:
            raise self._fail(f"receiving from rank {frm}", exc) from exc
        raw = memoryview(first.numpy().tobytes())
        magic, size, inline = struct.unpack("<qqq", raw[:_PREFIX])
        if magic != MAGIC or not 0 < size <= FRAME - _PREFIX or not -1 <= inline <= FRAME - _PREFIX - size:
            raise self.violated(f"rank {frm} sent a malformed frame (magic {magic:#x}, header {size} bytes)")
        try:
            header = json.loads(bytes(raw[_PREFIX:_PREFIX + size]))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self.violated(f"rank {frm} sent a frame header that is not JSON") from exc
        if not isinstance(header, dict) or not isinstance(header.get("nbytes"), int) or header["nbytes"] < 0 \
                or inline not in (-1, header["nbytes"]):
            raise self.violated(f"rank {frm} sent a frame header without a consistent payload size: "
                                f"{str(header)[:200]}")
        data = bytes(raw[_PREFIX + size:_PREFIX + size + inline]) if inline >= 0 else None
        return header, data

    def exchange(self, peer: int, tag: int, header: dict[str, Any], payload: Sequence[Buffer],
                 answer_tag: int) -> tuple[dict[str, Any], bytes | None]:
        """Send a frame to ``peer`` and receive the first message of its answer (one thread hop, not two)."""
        self.send(peer, tag, header, payload)
        return self.recv_header(peer, answer_tag)

    def _sizes(self, frm: int, header: dict[str, Any]) -> list[int]:
        """The sizes of a frame's payload messages: the header's ``pieces``, else :data:`CHUNK`-sized cuts."""
        nbytes = int(header["nbytes"])
        pieces = header.get("pieces")
        if pieces is None:
            return [min(CHUNK, nbytes - pos) for pos in range(0, nbytes, CHUNK)]
        if not isinstance(pieces, list) or len(pieces) > MAX_PIECES or sum(pieces) != nbytes \
                or not all(isinstance(n, int) and 0 < n <= CHUNK for n in pieces):
            raise self.violated(f"rank {frm} sent a frame whose pieces do not add up to its {nbytes} bytes")
        return pieces

    def payload(self, frm: int, tag: int, header: dict[str, Any], inline: bytes | None, out: memoryview) -> None:
        """Fill ``out`` (exactly the payload's size, writable) with a frame's payload: inline, or received."""
        self.scatter(frm, tag, header, inline, [out])

    def scatter(self, frm: int, tag: int, header: dict[str, Any], inline: bytes | None,
                views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order with a frame's payload (exactly their total size).

        Each message is received straight into its view where it falls inside one, else through a scratch copy.
        """
        total = sum(len(v) for v in views)
        if int(header["nbytes"]) != total:  # its messages cannot be matched any more: the link is down
            raise self.violated(f"rank {frm} sent {header['nbytes']} bytes where {total} were asked for")
        if inline is not None:
            pos = 0
            for v in views:
                v[:] = inline[pos:pos + len(v)]
                pos += len(v)
            return
        self._check()
        starts, pos = [], 0
        for v in views:
            starts.append(pos)
            pos += len(v)
        pending: list[tuple[Any, bytearray | None, int]] = []
        pg = self.group(frm, tag, False)
        try:
            with self._io(frm):
                pos, i = 0, 0
                for n in self._sizes(frm, header):
                    while i + 1 < len(views) and starts[i + 1] <= pos:
                        i += 1
                    inside = pos - starts[i]
                    if inside + n <= len(views[i]):  # the message lands inside one view: no copy
                        pending.append((pg.recv([_as_tensor(views[i][inside:inside + n])], frm, tag), None, pos))
                    else:
                        scratch = bytearray(n)
                        pending.append((pg.recv([_as_tensor(scratch)], frm, tag), scratch, pos))
                    pos += n
                self._payload_posted(frm, tag)
                for work, copy, at in pending:
                    work.wait()
                    if copy is not None:
                        _spread(copy, at, views, starts)
        except RuntimeError as exc:
            raise self._fail(f"receiving from rank {frm}", exc) from exc

    def discard(self, frm: int, tag: int, header: dict[str, Any], inline: bytes | None) -> None:
        """Drop a frame's payload (one this side refuses), receiving it one piece of memory at a time."""
        if inline is not None:
            return
        sizes = self._sizes(frm, header)
        scratch = memoryview(bytearray(max(sizes, default=0)))
        pg = self.group(frm, tag, False)
        try:
            with self._io(frm):
                for i, n in enumerate(sizes):
                    work = pg.recv([_as_tensor(scratch[:n])], frm, tag)
                    if i == len(sizes) - 1:
                        self._payload_posted(frm, tag)
                    work.wait()
        except RuntimeError as exc:
            raise self._fail(f"receiving from rank {frm}", exc) from exc


def _pieces(views: list[memoryview]) -> list[memoryview]:
    """The payload as messages, each at most :data:`CHUNK` bytes.

    Parts of at least :data:`DIRECT` bytes are sent from where they are; smaller ones are gathered into
    bounce copies between them.
    """
    out: list[memoryview] = []
    bounce = bytearray()
    for view in views:
        if len(view) < DIRECT:
            bounce += view
            if len(bounce) >= CHUNK:
                out.append(memoryview(bounce)[:CHUNK])
                bounce = bounce[CHUNK:]
            continue
        if bounce:
            out.append(memoryview(bounce))
            bounce = bytearray()
        out.extend(view[pos:pos + CHUNK] for pos in range(0, len(view), CHUNK))
    if bounce:
        out.append(memoryview(bounce))
    return out


def _spread(data: bytearray, at: int, views: Sequence[memoryview], starts: list[int]) -> None:
    """Copy ``data``, which sits at ``at`` in the concatenation of ``views``, into them."""
    end = at + len(data)
    for v, start in zip(views, starts, strict=True):
        lo, hi = max(at, start), min(end, start + len(v))
        if lo < hi:
            v[lo - start:hi - start] = data[lo - at:hi - at]


def _cut(views: list[memoryview]) -> list[memoryview]:
    """The payload copied into messages of :data:`CHUNK` bytes (the last one shorter)."""
    out: list[memoryview] = []
    bounce = bytearray()
    for view in views:
        pos = 0
        while pos < len(view):
            n = min(CHUNK - len(bounce), len(view) - pos)
            bounce += view[pos:pos + n]
            pos += n
            if len(bounce) == CHUNK:
                out.append(memoryview(bounce))
                bounce = bytearray()
    if bounce:
        out.append(memoryview(bounce))
    return out


def connect(store: Any, rank: int, world_size: int, generation: int, timeout_s: float,
            lanes: Sequence[int] | None = None) -> PeerLink:
    """Build this rank's end of the replication groups (every rank of the job calls it, alike; blocking).

    Args:
        store: the job's c10d store (a prefix of it is used).
        rank: this rank.
        world_size: the job's number of ranks.
        generation: distinguishes successive groups built over the same store.
        timeout_s: the groups' timeout: connecting, and every single wait.
        lanes: per rank, the group its own flow travels on (one group per distinct lane is built);
            None: one group for every flow.
    """
    import torch.distributed as dist

    groups = []
    for lane in range(max(lanes, default=0) + 1 if lanes is not None else 1):
        prefix = f"asymstore-peer/{generation}/" + (f"lane-{lane}/" if lane else "")
        prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        groups.append(dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout_s)))
    return PeerLink(groups, rank, timeout_s, lanes)
