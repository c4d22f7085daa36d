"""PeerTier: a rank's versions copied into the memory of a rank on another node, and read back from it.

Put it in a multi-rank store's tier list after the memory tier and before the
disk (``[HostTier(...), PeerTier(...), LocalTier(...)]`` with the memory tier as
``durable``): like any tier below the durable one it is written in the
background cascade — ``commit`` never waits for it, a slow peer only skips to
the newest version, and ``status()`` shows its lag. Writing sends the version's
segments and then its manifest to the ring neighbour (:mod:`asymstore.tiers.peer.ring`),
which verifies every segment's checksum and publishes the replica atomically in
its own bounded memory before it acknowledges; reading (restore) asks the
neighbour for the manifest and segments of a replica, which the store verifies
like any other tier's bytes. Every rank of the job must use a PeerTier (the
replication group is built collectively when the tiers open).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Sequence
from functools import partial
from typing import Any

from asymstore.errors import (
    CorruptVersionError,
    PeerError,
    TierError,
    VersionNotFoundError,
)
from asymstore.tiers.memory.factory import HostTier
from asymstore.tiers.peer.link import FRAME, TAG_ACK, TAG_REPL, TAG_REQ, TAG_RESP, PeerLink, blocking, connect
from asymstore.tiers.peer.ring import Ring, ring_of
from asymstore.tiers.peer.service import ReplicaService
from asymstore.tiers.protocol import Buffer, Tier

logger = logging.getLogger(__name__)

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
        from asymstore.dist.world import env_rank_world

        rank, world_size = env_rank_world(rank, world_size)
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
        self._requests = asyncio.Lock()
        self._held: list[int] | None = None
        self._deletes: set[int] = set()
        self._writing = asyncio.Lock()

    def __repr__(self) -> str:
        """Return a short description."""
        return f"PeerTier(rank {self.ring.rank} -> {self.ring.dst}, holds {self.ring.src}'s)"

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
        return HostTier(self.capacity_bytes, path=location, name=f"replicas-of-{src}", policy="skip")

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
        self._link = await blocking(partial(connect, store, ring.rank, ring.world_size, generation, self.timeout_s))
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
            async with self._writing, self._requests:
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
            for tag, lock in ((TAG_REPL, self._writing), (TAG_REQ, self._requests)):
                async with lock:
                    try:
                        await blocking(partial(self.link.send, self.ring.dst, tag, {"op": "ping"}))
                    except PeerError:
                        return

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

    async def _request(self, header: dict[str, Any], out_size: int = 0) -> tuple[dict[str, Any], bytearray]:
        """Send one request and receive its answer (and its payload, at most ``out_size`` bytes)."""
        async with self._requests:
            link, dst = self.link, self.ring.dst
            answer, inline = await blocking(partial(link.exchange, dst, TAG_REQ, header, (), TAG_RESP))
            n = int(answer["nbytes"])
            if n > out_size:
                await blocking(partial(link.discard, dst, TAG_RESP, answer, inline))
                raise CorruptVersionError(f"{self.name}: {header.get('op')} of step {header.get('step')}: "
                                          f"{n} bytes, at most {out_size} expected")
            body = bytearray(n)
            await blocking(partial(link.payload, dst, TAG_RESP, answer, inline, memoryview(body)))
        if not answer.get("ok"):
            err = _ERRORS.get(str(answer.get("error")), TierError)
            raise err(f"{self.name}: {answer.get('message')}")
        return answer, body

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
        """
        views = [memoryview(v).cast("B") for _, v in ranges]
        header = {"op": "ranges", "step": step, "name": name, "size": size,
                  "ranges": [[int(o), len(v)] for (o, _), v in zip(ranges, views, strict=True)]}
        if len(json.dumps(header)) > FRAME // 2:  # too many ranges for one request: the whole segment
            data = memoryview(await self.read_segment(step, name, size)).cast("B")
            for (offset, _), v in zip(ranges, views, strict=True):
                if offset < 0 or offset + len(v) > len(data):
                    raise CorruptVersionError(f"{self.name}: range {offset}+{len(v)} outside segment {name}")
                v[:] = data[offset:offset + len(v)]
            return None
        async with self._requests:
            link, dst = self.link, self.ring.dst
            answer, inline = await blocking(partial(link.exchange, dst, TAG_REQ, header, (), TAG_RESP))
            if answer.get("ok"):
                await blocking(partial(link.scatter, dst, TAG_RESP, answer, inline, views))
            elif int(answer["nbytes"]):
                await blocking(partial(link.discard, dst, TAG_RESP, answer, inline))
        if not answer.get("ok"):
            raise _ERRORS.get(str(answer.get("error")), TierError)(f"{self.name}: {answer.get('message')}")
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
