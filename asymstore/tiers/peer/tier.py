"""PeerTier: a rank's versions copied into the memory of a rank on another node, and read back from it.

Put it after the memory tier (the ``durable`` one) and before the disk:
``[host_tier(...), PeerTier(...), LocalTier(...)]``. It is written by the background cascade, so
``commit`` never waits for it and a slow peer skips to the newest version. Writing sends the
segments, then the manifest, to the ring neighbour (:mod:`asymstore.tiers.peer.ring`), which
verifies them and publishes the replica atomically before it acknowledges; reading asks the
neighbour for a replica, with up to :data:`PIPELINE` requests in flight, and an answer that does
not match its request fails every pending one with :class:`~asymstore.errors.PeerError`, never
with wrong bytes. Every rank of the job must use a PeerTier; its write cost is probed at ``open``
(:class:`~asymstore.tiers.protocol.ProbeableTier`), never cached.

Placement, replication and recovery: docs/guides/multirank.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from asymstore.errors import (
    CorruptVersionError,
    PeerError,
    TierError,
    VersionNotFoundError,
)
from asymstore.tiers.memory.factory import host_tier
from asymstore.tiers.peer.link import (
    FRAME,
    TAG_ACK,
    TAG_REPL,
    TAG_REQ,
    TAG_RESP,
    PeerLink,
    blocking,
    connect,
    in_thread,
)
from asymstore.tiers.peer.ring import Ring, lanes_of, ring_of
from asymstore.tiers.peer.service import MAX_PROBE_BYTES, ReplicaService
from asymstore.tiers.protocol import Buffer, Tier

logger = logging.getLogger(__name__)

T = TypeVar("T")

PIPELINE = 4
"""Read requests in flight to the neighbour at most. Each answer lands in its caller's own buffer, so what
they hold is what the callers asked for; the store itself reads a few segments at a time."""
RANGES_HEADER = FRAME // 2
"""Bytes of JSON a ``ranges`` request may take; more ranges than that go in several requests."""

_ERRORS: dict[str, type[Exception]] = {"VersionNotFoundError": VersionNotFoundError,
                                       "CorruptVersionError": CorruptVersionError}


class PeerTier:
    """This rank's replicas on its ring neighbour, and the neighbour's replicas here.

    Args:
        capacity_bytes: memory for the replicas this rank holds for its source rank.
        path: a shared-memory directory for those replicas (they outlive this process,
            so a restarted job can still serve them); None keeps them in process memory.
        rank: this rank; default ``RANK`` (or torch.distributed).
        world_size: the job's ranks; default ``WORLD_SIZE`` (or torch.distributed).
        node_of: the node of each rank (see :func:`~asymstore.tiers.peer.ring.ring_of`); default
            ``local_world_size`` ranks per node, numbered node by node.
        local_world_size: ranks per node; default ``LOCAL_WORLD_SIZE``.
        keep: replicas held per source rank.
        timeout_s: the replication group's timeout: connecting, and any single wait (an
            acknowledgement, an answer).
        close_timeout_s: how long ``close`` waits for the source rank to say goodbye.
        store: the job's c10d store (default: a client of ``MASTER_ADDR:MASTER_PORT``).
        name: the tier's name (default ``"peer:rank-<dst>"``).
    """

    persistent = False

    def __init__(self, capacity_bytes: int = 2 << 30, *, path: str | os.PathLike[str] | None = None,
                 rank: int | None = None, world_size: int | None = None, node_of: Sequence[int] | None = None,
                 local_world_size: int | None = None, keep: int = 2, timeout_s: float = 300.0,
                 close_timeout_s: float = 60.0, store: Any = None, name: str | None = None) -> None:
        """Configure; the group is built in ``open``."""
        from asymstore.dist.world import rank_world

        rank, world_size = rank_world(rank, world_size)
        self.ring: Ring = ring_of(rank, world_size, node_of=node_of, local_world_size=local_world_size)
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.name = name or f"peer:rank-{self.ring.dst}"
        self.keep_last: int | None = None
        self.capacity_bytes = capacity_bytes
        self.path = None if path is None else os.fspath(path)
        self.keep = keep
        self.timeout_s = timeout_s
        self.close_timeout_s = close_timeout_s
        self._store = store
        self._link: PeerLink | None = None
        self._service: ReplicaService | None = None
        self._order = asyncio.Lock()  # requests are sent one at a time, in the order their answers are read
        self._slots = asyncio.Semaphore(PIPELINE)
        self._next_id = 0
        self._tail: asyncio.Future[None] | None = None  # done when the answer of the latest request is read
        self._held: list[int] | None = None
        self._deletes: set[int] = set()
        self._writing = asyncio.Lock()

    def __repr__(self) -> str:
        """Return a short description."""
        return f"PeerTier(rank {self.ring.rank} -> {self.ring.dst}, holds {self.ring.src}'s)"

    def wants_bytes_proof(self) -> bool:
        """True: the receiver checks each segment's bytes on arrival, before it has the manifest.

        (:class:`~asymstore.tiers.protocol.BytesProofTier`.)
        """
        return True

    @property
    def service(self) -> ReplicaService | None:
        """The receiving end (replicas of ``ring.src`` held here), once open."""
        return self._service

    def held_replicas(self) -> tuple[int, str | None]:
        """The rank whose replicas this rank holds, and their directory (``path/of-rank-NNNNN``; None: in memory)."""
        src = self.ring.src
        if self.path is None:
            return src, None
        return src, os.path.join(os.path.abspath(self.path), f"of-rank-{src:05d}")

    def replica_tier(self) -> Tier:
        """A new, unopened tier for the replicas this rank holds (``path/of-rank-NNNNN`` in shared memory)."""
        src, location = self.held_replicas()
        return host_tier(self.capacity_bytes, path=location, name=f"replicas-of-{src}", policy="skip")

    @property
    def background_error(self) -> str | None:
        """The latest failure of this tier's own threads (in ``status()``): the replica service's, else the link's."""
        service, link = self._service, self._link
        if service is not None and service.last_error is not None:
            return f"replicas of rank {self.ring.src} held here: {service.last_error}"
        if link is not None and link.broken is not None:
            return f"peer link down: {link.broken}"
        return None

    @property
    def link(self) -> PeerLink:
        """The replication link (after ``open``)."""
        if self._link is None:
            raise PeerError("the peer tier is not open")
        return self._link

    # -- lifecycle -------------------------------------------------------

    async def open(self) -> None:
        """Build the replication group with every other rank, open the replica tier, start the service."""
        if self._link is not None:
            return
        ring = self.ring
        store = self._store
        if store is None:
            from asymstore.dist.kv import store_from_env

            if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
                raise PeerError("the peer tier needs the job's c10d store: set MASTER_ADDR and MASTER_PORT "
                                "(torchrun does) or pass store=")
            store = await asyncio.to_thread(store_from_env, "peer", timeout_s=self.timeout_s)
        generation = await asyncio.to_thread(store.add, f"asymstore-peer-generation/{ring.rank}", 1)
        self._link = await blocking(partial(connect, store, ring.rank, ring.world_size, generation, self.timeout_s,
                                            lanes_of(ring)))
        self._service = ReplicaService(self._link, ring.src, self.replica_tier(), keep=self.keep)
        await asyncio.to_thread(self._service.start)
        self._keepalive = asyncio.get_running_loop().create_task(self._ping())
        logger.info("peer tier of rank %d: replicas to rank %d, holding rank %d's", ring.rank, ring.dst, ring.src)

    async def close(self) -> None:
        """Say goodbye to the neighbour, wait (bounded) for the source rank's goodbye, then end the link.

        Ending the link fails the gloo waits still pending (a dead or silent peer's), so that no thread
        is left blocked in the group once it is dropped (see :meth:`~asymstore.tiers.peer.link.PeerLink.end`).
        """
        link, service = self._link, self._service
        if link is None:
            return
        self._keepalive.cancel()
        if link.broken is None:
            async with self._writing, self._order:
                if self._tail is not None:  # the answers still due are read first
                    await asyncio.shield(self._tail)
                with contextlib.suppress(PeerError):
                    await self._send_deletes()
                for tag in (TAG_REPL, TAG_REQ):
                    try:
                        await blocking(partial(link.send, self.ring.dst, tag, {"op": "bye"}), 10.0)
                    except (PeerError, TimeoutError) as exc:
                        logger.info("peer tier of rank %d: goodbye not sent: %s", self.ring.rank, exc)
                        break
        if service is not None:
            await asyncio.to_thread(service.stop, self.close_timeout_s)
        await asyncio.to_thread(link.end, "the peer tier is closed", 1.0)
        self._link = None

    async def _ping(self) -> None:
        """Keep the neighbour's idle receives from timing out (gloo closes a timed-out connection)."""
        while True:
            await asyncio.sleep(max(self.timeout_s / 4, 0.5))
            for tag, lock in ((TAG_REPL, self._writing), (TAG_REQ, self._order)):
                async with lock:
                    try:
                        await blocking(partial(self.link.send, self.ring.dst, tag, {"op": "ping"}))
                    except PeerError:
                        return

    # -- calibration -----------------------------------------------------

    def calibration_key(self) -> str | None:
        """None: a link's cost is measured at every open, never cached (it depends on the neighbour)."""
        return None

    async def probe_writes(self, sizes: Sequence[int]) -> list[float]:
        """Seconds to send one frame of each size and have the neighbour receive, checksum and acknowledge it.

        Raises:
            OSError: the neighbour did not answer a probe as one (the link is then down; the store falls
                back to the assumed calibration, and writes to this tier fail as they would anyway).
        """
        link, dst = self.link, self.ring.dst
        if any(not 0 <= n <= MAX_PROBE_BYTES for n in sizes):
            raise ValueError(f"probe sizes {list(sizes)} are not within 0..{MAX_PROBE_BYTES}")
        payload = memoryview(bytearray(max(sizes, default=0)))
        out: list[float] = []
        async with self._writing:
            for n in sizes:
                t0 = time.perf_counter()
                try:
                    ack, _ = await blocking(partial(link.exchange, dst, TAG_REPL, {"op": "probe"}, [payload[:n]],
                                                    TAG_ACK), self.timeout_s)
                except (PeerError, TimeoutError) as exc:
                    link.broken = link.broken or f"probing the link: {exc!r}"  # a wait may still be in flight
                    raise OSError(f"{self.name}: probe of {n} bytes: {exc!r}") from exc
                out.append(time.perf_counter() - t0)
                if ack.get("op") != "probe" or ack.get("nbytes") != 0 or ack.get("ok") is not True:
                    raise OSError(f"{self.name}: {link.violated(f'rank {dst} answered a probe with {str(ack)[:200]}')}")
        return out

    # -- writing ---------------------------------------------------------

    async def begin(self, step: int, nbytes: int) -> PeerWriter:
        """Start sending version ``step`` (every frame asks the neighbour to reserve ``nbytes``)."""
        await self._writing.acquire()
        try:
            await self._send_deletes()
        except BaseException:
            self._writing.release()
            raise
        return PeerWriter(self, step, nbytes)

    def _sent(self, step: int, name: str, nbytes: int) -> None:
        """Called after each segment is sent (a hook for fault-injection tests)."""

    # -- reading ---------------------------------------------------------

    async def _call(self, header: dict[str, Any], receive: Callable[[PeerLink, int, dict[str, Any], bytes | None], T],
                    ) -> T:
        """Send one request, and run ``receive(link, peer, answer, inline)`` on its answer (on a thread).

        At most :data:`PIPELINE` requests are in flight; answers are read in the order the requests
        went out. The exchange runs in a task of its own, shielded from the caller's cancellation: once a
        request is sent its answer is always read (else every later answer would be taken for the one
        before it); ``receive`` may then still write into the caller's buffers, which it keeps alive.
        """
        return await asyncio.shield(asyncio.get_running_loop().create_task(self._exchange(header, receive)))

    async def _exchange(self, header: dict[str, Any],
                        receive: Callable[[PeerLink, int, dict[str, Any], bytes | None], T]) -> T:
        async with self._slots:
            async with self._order:
                link, dst = self.link, self.ring.dst
                rid = self._next_id
                self._next_id += 1
                await blocking(partial(link.send, dst, TAG_REQ, {**header, "id": rid}))
                before, mine = self._tail, asyncio.get_running_loop().create_future()
                self._tail = mine
            loop = asyncio.get_running_loop()
            try:
                if before is not None:
                    await asyncio.shield(before)  # its answer first (the future only says when: it never fails)
                reading = in_thread(partial(self._answer, link, dst, rid, header, receive))
            except BaseException:  # cancelled before its answer was read: the next one reads it, and refuses it
                self._turn(mine)
                raise

            def done(_: object) -> None:  # the next answer is read only once this thread has stopped reading
                if not loop.is_closed():
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(self._turn, mine)

            reading.add_done_callback(done)
            return await asyncio.wrap_future(reading)

    def _turn(self, mine: asyncio.Future[None]) -> None:
        """The answer ``mine`` stands for is read (or never will be): the next request's turn."""
        if not mine.done():
            mine.set_result(None)
        if self._tail is mine:
            self._tail = None

    def _answer(self, link: PeerLink, dst: int, rid: int, header: dict[str, Any],
                receive: Callable[[PeerLink, int, dict[str, Any], bytes | None], T]) -> T:
        """Read the answer to request ``rid`` (its first message, checked), then ``receive`` the rest."""
        answer, inline = link.recv_header(dst, TAG_RESP)
        if answer.get("id") != rid:
            raise link.violated(f"rank {dst} answered request {answer.get('id')!r} where {rid} "
                                f"({header.get('op')}) was due")
        # a later request is out: its answer's first message is received as soon as this one's payload is asked for
        with link.reading_ahead(dst, TAG_RESP, self._next_id > rid + 1):
            if not answer.get("ok"):
                if int(answer["nbytes"]):
                    link.discard(dst, TAG_RESP, answer, inline)
                raise _ERRORS.get(str(answer.get("error")), TierError)(f"{self.name}: {answer.get('message')}")
            return receive(link, dst, answer, inline)

    async def _request(self, header: dict[str, Any], out_size: int = 0) -> tuple[dict[str, Any], bytearray]:
        """Send one request and receive its answer (and its payload, at most ``out_size`` bytes)."""
        def receive(link: PeerLink, dst: int, answer: dict[str, Any], inline: bytes | None,
                    ) -> tuple[dict[str, Any], bytearray]:
            n = int(answer["nbytes"])
            if n > out_size:  # refused unread, a piece at a time: the link stays in step
                link.discard(dst, TAG_RESP, answer, inline)
                raise CorruptVersionError(f"{self.name}: {header.get('op')} of step {header.get('step')}: "
                                          f"{n} bytes, at most {out_size} expected")
            body = bytearray(n)
            link.payload(dst, TAG_RESP, answer, inline, memoryview(body))
            return answer, body

        return await self._call(header, receive)

    async def list_versions(self) -> list[int]:
        """The steps of this rank's replicas the neighbour holds, ascending.

        Asked once; then kept from what each acknowledgement and deletion says (one round trip less per version).
        """
        if self._held is None:
            answer, _ = await self._request({"op": "list"})
            steps = answer.get("steps")
            if not isinstance(steps, list) or not all(isinstance(s, int) for s in steps):
                raise CorruptVersionError(f"{self.name}: listing is not a list of steps")
            self._held = sorted(steps)
        return list(self._held)

    async def read_manifest(self, step: int) -> bytes:
        """The manifest of replica ``step`` (unverified: the store checks it)."""
        from asymstore.format.manifest import MAX_MANIFEST_BYTES

        return bytes((await self._request({"op": "manifest", "step": step}, MAX_MANIFEST_BYTES))[1])

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        """One segment of replica ``step``, of exactly ``size`` bytes when given."""
        _, body = await self._request({"op": "segment", "step": step, "name": name, "size": size},
                                      size if size is not None else self.capacity_bytes)
        if size is not None and len(body) != size:
            raise CorruptVersionError(f"{self.name}: segment {name} of step {step}: {len(body)} bytes, not {size}")
        return body

    async def read_segment_into(self, step: int, name: str, size: int,
                                ranges: Sequence[tuple[int, memoryview]]) -> list[str] | None:
        """Fill each ``(offset, view)`` with those bytes of segment ``name``.

        Only those bytes travel, straight into the views; the caller verifies them (no digests are returned).
        Ranges too many for one request's header go in several, pipelined like any others.
        """
        views = [memoryview(v).cast("B") for _, v in ranges]
        if not views:
            return None
        pairs = [[int(o), len(v)] for (o, _), v in zip(ranges, views, strict=True)]
        for offset, length in pairs:
            if offset < 0 or offset + length > size:
                raise CorruptVersionError(f"{self.name}: range {offset}+{length} outside segment {name} "
                                          f"of {size} bytes")
        groups: list[tuple[int, int]] = []  # [start, end) of the pairs each request carries
        start, room = 0, 0
        for i, pair in enumerate(pairs):
            cost = len(json.dumps(pair)) + 1
            if i > start and room + cost > RANGES_HEADER:
                groups.append((start, i))
                start, room = i, 0
            room += cost
        groups.append((start, len(pairs)))

        def receive(part: list[memoryview]) -> Callable[[PeerLink, int, dict[str, Any], bytes | None], None]:
            def fill(link: PeerLink, dst: int, answer: dict[str, Any], inline: bytes | None) -> None:
                link.scatter(dst, TAG_RESP, answer, inline, part)  # exactly their bytes, else the link is down
            return fill

        await asyncio.gather(*(self._call({"op": "ranges", "step": step, "name": name, "size": size,
                                           "ranges": pairs[lo:hi]}, receive(views[lo:hi]))
                               for lo, hi in groups))
        return None

    async def delete_version(self, step: int) -> None:
        """Delete replica ``step`` on the neighbour: sent before the next version (or on close), never waited for.

        A commit's retention must not wait for the replication of an earlier version in flight.
        """
        self._deletes.add(step)
        if self._held is not None and step in self._held:
            self._held.remove(step)

    async def _send_deletes(self) -> None:
        """Send the deletions queued so far (the caller holds the write lock)."""
        for step in sorted(self._deletes):
            await blocking(partial(self.link.send, self.ring.dst, TAG_REPL, {"op": "delete", "step": step}))
            self._deletes.discard(step)

    async def quarantine(self, step: int) -> None:
        """A replica that failed verification is deleted (the neighbour keeps no inspection copy)."""
        await self.delete_version(step)

    async def write_latest(self, step: int) -> None:
        """No hint is kept: ``list_versions`` asks the neighbour."""

    async def read_latest(self) -> int | None:
        """No hint is kept (None)."""
        return None


class PeerWriter:
    """Sends one version's segments and manifest to the neighbour; ``publish`` returns once it verified them."""

    def __init__(self, tier: PeerTier, step: int, reserve: int) -> None:
        """Begun by :meth:`PeerTier.begin` (which holds the tier's write lock until publish or abort)."""
        self.tier, self.step, self.reserve = tier, step, reserve
        self._open = True
        self._sent_any = False

    def _frame(self, op: str, **fields: Any) -> dict[str, Any]:
        return {"op": op, "step": self.step, "reserve": self.reserve, **fields}

    async def write_segment(self, name: str, parts: Sequence[Buffer]) -> None:
        """Send one segment."""
        tier = self.tier
        self._sent_any = True
        await blocking(partial(tier.link.send, tier.ring.dst, TAG_REPL, self._frame("segment", name=name), parts))
        tier._sent(self.step, name, sum(len(memoryview(p)) for p in parts))

    async def publish(self, manifest: bytes) -> None:
        """Send the manifest and wait for the neighbour's verdict (at most the tier's timeout).

        Raises:
            PeerError: the neighbour refused the replica, did not answer, or is gone.
        """
        tier, link = self.tier, self.tier.link
        try:
            self._sent_any = True
            ack, _ = await blocking(partial(link.exchange, tier.ring.dst, TAG_REPL, self._frame("manifest"),
                                            [manifest], TAG_ACK))
        finally:
            self._finish()
        held = ack.get("held")
        if isinstance(held, list) and all(isinstance(h, int) for h in held):
            tier._held = sorted(held)
        if ack.get("step") != self.step or not ack.get("ok"):
            raise PeerError(f"{tier.name}: replica of step {self.step} refused: {ack.get('reason')}")

    async def abort(self) -> None:
        """Tell the neighbour to drop what it received of this version."""
        if not self._open:
            return
        tier = self.tier
        try:
            if self._sent_any and tier.link.broken is None:
                await blocking(partial(tier.link.send, tier.ring.dst, TAG_REPL, self._frame("abort")), 10.0)
        except (PeerError, TimeoutError) as exc:
            logger.info("%s: abort of step %d not sent: %s", tier.name, self.step, exc)
        finally:
            self._finish()

    def _finish(self) -> None:
        if self._open:
            self._open = False
            self.tier._writing.release()
