"""RankStore: one rank's shard store of a multi-rank checkpoint, with a two-phase global commit.

Every rank commits its shard of a step to its own tiers (its own :class:`~asymstore.AsymStore`,
``RankStore.local``) and reports it through the job's coordination store; the coordinator (rank 0)
waits for every report, then publishes ``global/v…json`` (:mod:`.publish`, :mod:`.globaldir`) and
applies retention (:mod:`.retention`): only then does the version exist. Waiting happens on the
store's loop thread and through the key-value store only, never a collective. ``restore`` is
collective: every rank loads the same global version, or every rank the one before
(:mod:`.restore`).

Guide: ``docs/guides/multirank.md``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Unpack

from asymstore.dist.fabric import Fabric
from asymstore.dist.kv import KV, MemoryStore, store_from_env
from asymstore.dist.topology import Topology
from asymstore.dist.world import rank_world
from asymstore.errors import (
    AsymstoreError,
    CoordinationProtocolError,
    CoordinationTimeoutError,
    GlobalManifestError,
    GlobalVersionDroppedError,
    NoCheckpointError,
    describe,
)
from asymstore.format.checksum import checksum
from asymstore.format.globalmanifest import GlobalManifest, ShardInfo, shard_digest
from asymstore.format.manifest import Manifest, validate_meta
from asymstore.format.placement import RankPlacement
from asymstore.format.replicas import REPLICAS_KEY
from asymstore.io.rootlock import DirLock, sweep_directory
from asymstore.multirank import globaldir, protocol, rootlayout, takeover
from asymstore.multirank.job import Job
from asymstore.multirank.locate import rank_placement
from asymstore.multirank.peers import read_peer_shard, read_shard_manifest
from asymstore.multirank.publish import await_global, publish_global
from asymstore.multirank.restore import Chosen, restore_collective, whole_manifest
from asymstore.multirank.retention import (
    delete_shard,
    retain_shards,
    retire_departed_shards,
    roll_back,
    shard_floor,
)
from asymstore.multirank.rootlayout import AcrossLayouts, check_across
from asymstore.policy.retention import KeepBest, Retention
from asymstore.protocols import CheckpointStore
from asymstore.store import AsymStore, StoreOptions
from asymstore.tiers.location import rank_tier
from asymstore.tiers.protocol import Tier
from asymstore.values import Checkpoint, CommitResult, Targets

if TYPE_CHECKING:
    from asymstore.values import Into, TierCalibration, TierStatus

logger = logging.getLogger(__name__)

OwnTierSlices = Literal["exchange", "whole"]
"""What ranks with tiers of their own do with a replicated state: write slices and exchange them at a restore, or
write whole copies (see ``RankStore(own_tier_slices=...)``)."""

REPLICAS_WHOLE = "replicas-whole"
"""The session key the coordinator puts when the job falls back to whole copies of its replicated state."""



class RankStore:
    """This rank's store of a multi-rank checkpoint under ``root`` (see the module docstring).

    It holds this rank's own :class:`~asymstore.AsymStore` (``local``, over
    ``tiers``) and adds the global commit and the collective restore; it is a
    :class:`~asymstore.protocols.CheckpointStore`, so it goes wherever the
    adapters take a store (e.g. as the store of :class:`asymcheck.Checkpointer`
    under DDP). Every rank must commit the same steps, and every rank must
    call ``restore``.

    Args:
        root: the multi-rank root (shared by all ranks; the coordinator writes ``global/`` there).
        rank: this rank (default: ``RANK`` from the environment, or torch.distributed).
        world_size: the number of ranks (default: ``WORLD_SIZE``, or torch.distributed).
        tiers: this rank's tiers, fastest first (default: ``LocalTier(root/rank-NNNNN)``).
        peer_tiers: rank -> tiers to read another rank's shards (default: its ``LocalTier``).
        kv: a ``torch.distributed.Store`` for coordination (default: a new TCPStore client
            to ``MASTER_ADDR:MASTER_PORT`` when ``world_size > 1``).
        keep_last: global versions kept; shards no kept version needs are deleted. None keeps all.
        keep_every: also keep every global version whose step is a multiple of it, permanently.
        keep_best: also keep the best global versions by a metric of the coordinator's
            ``meta["metrics"]`` (see :class:`~asymstore.KeepBest`). Both are judged on the global
            versions and recorded in their global manifests (a restart keeps the same set);
            every rank must be given the same rules.
        timeout_s: how long the coordinator waits for every rank's report at a commit
            (and ranks with ``wait_global`` for the coordinator).
        restore_timeout_s: how long ranks wait for each other during ``restore``.
        wait_global: non-coordinator ranks return from ``commit`` only once the global
            version is published (the coordinator always waits).
        namespace: key prefix in the c10d store (default: derived from ``root``).
        fsync: flush files and directories (the default tiers and the global directory).
        across_layouts: what ``restore`` does when ``root`` holds single-process versions and no global
            version (:data:`~asymstore.multirank.rootlayout.AcrossLayouts`): ``"resume"`` the newest (every rank
            reads its part from the root, as from a version of another world size: ``reshard`` must be set,
            else :class:`~asymstore.errors.WorldSizeMismatchError`), or ``"start_fresh"`` beside them. The
            first global commit records the root as multi-rank (:mod:`.rootlayout`); under ``"resume"`` it is
            refused on every rank (:class:`~asymstore.errors.LayoutTakeoverError`) unless ``restore``
            resumed one of them.
        own_tier_slices: with ``tiers`` or ``peer_tiers`` given (each rank's tiers its own: node-local disks,
            shared memory, peer replicas), whether a writer may cut slices of a replicated state
            (:data:`OwnTierSlices`): ``"exchange"`` (each rank writes its slice; at a restore each rank loads
            its own shard and the ranks exchange the slices over the training process group, as
            :class:`asymcheck.Checkpointer` does: :mod:`asymstore.multirank.sliceexchange`), or ``"whole"``
            (every rank writes whole copies). Ranks on the default tiers under a shared root read each
            other's slices there.
        node_size: ranks per node, numbered node by node (default: ``LOCAL_WORLD_SIZE`` from the
            environment, else one node). Off the coordinator's node the protocol goes through each node's
            leader (``LOCAL_RANK`` 0): O(nodes) requests per round on the job's store
            (:mod:`asymstore.dist.fabric`).
        **store_kwargs: options of this rank's own :class:`~asymstore.AsymStore`
            (:class:`~asymstore.store.StoreOptions`: ``segment_bytes``, ``compression``...).
    """

    def __init__(self, root: str | os.PathLike[str], *, rank: int | None = None, world_size: int | None = None,
                 tiers: Sequence[Tier] | None = None, peer_tiers: Callable[[int], Sequence[Tier]] | None = None,
                 kv: Any = None, keep_last: int | None = 3, keep_every: int | None = None,
                 keep_best: KeepBest | None = None, timeout_s: float = 300.0,
                 restore_timeout_s: float = 1800.0, wait_global: bool = False, namespace: str | None = None,
                 fsync: bool = True, across_layouts: AcrossLayouts = "resume", node_size: int | None = None,
                 own_tier_slices: OwnTierSlices = "exchange",
                 **store_kwargs: Unpack[StoreOptions]) -> None:
        """Configure; nothing is opened before ``open``."""
        rank, world_size = rank_world(rank, world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep everything)")
        rules = Retention(keep_last, keep_every, keep_best)  # checks the rules
        abs_root = os.path.abspath(os.fspath(root))
        self.job = Job(
            root=abs_root, global_dir=os.path.join(abs_root, globaldir.GLOBAL_DIR), rank=rank, world_size=world_size,
            fsync=fsync, timeout_s=timeout_s, restore_timeout_s=restore_timeout_s, global_keep_last=keep_last,
            peer_tiers=peer_tiers or (lambda r: [rank_tier(abs_root, r, read_only=False, fsync=fsync)]),
            rules=rules if rules.reads_notes else None, across_layouts=check_across(across_layouts))
        """What the multi-rank helpers use of this store (rank, world, global directory, coordination, timeouts)."""
        self.job.shards_under_root = tiers is None and peer_tiers is None
        if own_tier_slices not in ("exchange", "whole"):
            raise ValueError(f"own_tier_slices must be 'exchange' or 'whole', not {own_tier_slices!r}")
        self.job.exchange_slices = not self.job.shards_under_root and own_tier_slices == "exchange"
        self._global_lock = DirLock(self.job.global_dir)
        if tiers is None:
            tiers = self.job.peer_tiers(rank)
        self._shard_floor: int | None = None  # the oldest own shard the global retention keeps (None: not known)
        self.local = AsymStore(tiers, keep_last=None, retention_floor=self._sweep_floor, **store_kwargs)
        """This rank's own shards (retention follows the global versions, so it keeps everything itself)."""
        self.topology = Topology.of(world_size, node_size)
        """The job's nodes: the protocol aggregates through each node's leader (:mod:`asymstore.dist.fabric`)."""
        self.wait_global = wait_global
        self.namespace = namespace or checksum(self.root.encode())[:12]
        self._kv_given = kv
        self._session = 0
        self._counters: dict[str, int] = {}
        self._floor: int | None = None  # own shards above this step may be rolled back
        self._commit_tags: dict[int, str] = {}
        self._last_commit: protocol.CommitRound | None = None
        self.last_global: GlobalManifest | None = None
        """The newest global version this rank saw published (the coordinator's, after each commit)."""
        self._restored_global: GlobalManifest | None = None
        self._restored: Chosen | None = None  # what restore chose, as this rank heard it
        self.published_step: int | None = None
        """The newest global step this rank saw published (its commits; non-coordinators: once waited for)."""
        self.reshard: Targets | None = None
        """Set it to restore versions written by another number of ranks (see :mod:`.reshard`)."""
        self.placement: RankPlacement | None = None
        """Where this rank's tiers are (after ``open``): reported with every shard, recorded in ``global/``."""
        self._takeover: takeover.Verdict | None = None  # the coordinator's look at the root (:mod:`.takeover`)

    def _sweep_floor(self) -> int | None:
        """The local store's sweep asks: below which own shard step a manifest-less shard is a retention delete's."""
        if self._shard_floor is None:  # until retention told one: from the kept global versions on disk
            self._shard_floor = shard_floor(self.job)
        return self._shard_floor

    def _note_floor(self, step: int) -> None:
        self._shard_floor = step

    # -- the job (see :class:`~asymstore.multirank.job.Job`) ---------------

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.job.rank

    @property
    def world_size(self) -> int:
        """The job's number of ranks."""
        return self.job.world_size

    @property
    def root(self) -> str:
        """The multi-rank root (absolute)."""
        return self.job.root

    @property
    def global_dir(self) -> str:
        """``root/global``: global manifests and placement records."""
        return self.job.global_dir

    @property
    def fsync(self) -> bool:
        """Whether files and directories of the global directory are flushed."""
        return self.job.fsync

    @property
    def timeout_s(self) -> float:
        """Longest wait of a global commit for every rank's report."""
        return self.job.timeout_s

    def peer_tiers(self, rank: int) -> Sequence[Tier]:
        """Unopened tiers to read ``rank``'s shards from."""
        return self.job.peer_tiers(rank)

    @property
    def is_coordinator(self) -> bool:
        """True on rank 0, which publishes global manifests."""
        return self.job.is_coordinator

    # -- this rank's own store -------------------------------------------

    @property
    def tiers(self) -> list[Tier]:
        """This rank's tiers, fastest first."""
        return self.local.tiers

    @property
    def durable_tier(self) -> Tier:
        """The tier ``commit`` waits for (this rank's)."""
        return self.local.durable_tier

    def versions(self) -> dict[str, list[int]]:
        """This rank's committed shard steps per tier name, ascending."""
        return self.local.versions()

    @property
    def newest_step(self) -> int | None:
        """This rank's newest committed shard step (a global version needs every rank's: see ``global_steps``)."""
        return self.local.newest_step

    def status(self) -> dict[str, TierStatus]:
        """Per tier name of this rank: see :meth:`asymstore.AsymStore.status`."""
        return self.local.status()

    async def refresh(self) -> None:
        """Re-read the shard steps each of this rank's tiers lists."""
        await self.local.refresh()

    async def flushed(self, step: int | None = None, *, tier: Tier | str | None = None,
                      timeout: float | None = None) -> None:
        """Wait for this rank's background tiers (see :meth:`asymstore.AsymStore.flushed`)."""
        await self.local.flushed(step, tier=tier, timeout=timeout)

    async def recalibrate(self) -> dict[str, TierCalibration]:
        """Measure this rank's tiers again (see :meth:`asymstore.AsymStore.recalibrate`)."""
        return await self.local.recalibrate()

    # -- lifecycle -------------------------------------------------------

    async def open(self) -> RankStore:
        """Open the tiers, connect to the coordination store, and create ``global/`` (coordinator).

        The coordinator holds the root's writer lock too while the job takes a single-process root over
        (until its first global version: :mod:`.takeover`).

        Raises:
            RootLockedError: (coordinator) another job holds ``global/``, or a single-process writer holds
                the single-process root this job would take over (the other ranks' ``restore`` and
                ``commit`` raise it too).
        """
        if self.job.client is None:
            if self._kv_given is not None:
                self.job.client = KV(self._kv_given)
            elif self.world_size == 1:
                self.job.client = KV(MemoryStore())
            else:
                self.job.client = KV(await asyncio.to_thread(store_from_env, self.namespace, timeout_s=self.timeout_s))
        self._session = await asyncio.to_thread(protocol.open_session, self.job.kv, self.rank)
        link = Fabric(self.job.kv, self.topology, self.rank)
        await asyncio.to_thread(link.connect, protocol.session_key(self._session, "nodes"), self.timeout_s)
        self.job.link = link
        self._takeover = None
        if self.is_coordinator:  # the only writer of global/: lock it, then sweep what a dead coordinator left
            try:  # and look at the root: every rank hears the verdict, or the error, typed
                await asyncio.to_thread(os.makedirs, self.global_dir, exist_ok=True)
                await asyncio.to_thread(self._global_lock.acquire)
                await asyncio.to_thread(sweep_directory, self.global_dir, fsync=self.fsync)
                self._takeover = await asyncio.to_thread(takeover.survey_at_open, self.job)
            except AsymstoreError as exc:
                takeover.release_root(self.job)
                self._global_lock.release()
                await takeover.share(self.job, protocol.layout_key(self._session), error=exc)
                raise
            except BaseException:
                takeover.release_root(self.job)
                self._global_lock.release()
                raise
            try:
                await takeover.share(self.job, protocol.layout_key(self._session), self._takeover)
            except BaseException:
                takeover.release_root(self.job)
                self._global_lock.release()
                raise
        try:
            await self.local.open()
        except BaseException:
            takeover.release_root(self.job)
            self._global_lock.release()
            raise
        self.placement = rank_placement(self.local.tiers, self.rank)
        return self

    async def __aenter__(self) -> RankStore:
        """Open the store."""
        return await self.open()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        """Close the store (waits for background flushes)."""
        await self.close()

    async def close(self) -> None:
        """Close; a non-coordinator first waits briefly for its last global commit and drops shards it made obsolete."""
        if self.job.client is not None and self._last_commit is not None and not self.is_coordinator:
            try:
                await asyncio.to_thread(self._last_commit.wait_answer, min(self.timeout_s, 30.0),
                                        "the last global commit")
                await retain_shards(self.local, self.job.fabric, self.rank, by_rules=self.job.rules is not None,
                                    floor=self._note_floor)
            except (CoordinationTimeoutError, CoordinationProtocolError, RuntimeError) as exc:
                logger.info("rank %d closing without the last global commit: %s", self.rank, exc)
            self._last_commit = None
        try:
            await self.local.close()
        finally:
            if self.job.link is not None:
                self.job.link.close()
            takeover.release_root(self.job)
            self._global_lock.release()

    async def _layout_verdict(self, timeout_s: float) -> takeover.Verdict:
        """The coordinator's look at the root at ``open`` (its error, typed, on every rank)."""
        if self._takeover is None:
            self._takeover = await takeover.verdict(self.job, protocol.layout_key(self._session), timeout_s)
        return self._takeover

    def _key(self, kind: str) -> str:
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        return protocol.round_key(self._session, kind, n)

    def session_key(self, name: str) -> str:
        """A coordination key of this session (the same on every rank that opened the store as often)."""
        return protocol.session_key(self._session, name)

    @property
    def kv(self) -> KV:
        """The coordination store (after ``open``; StoreClosedError before)."""
        return self.job.kv

    def coordination(self) -> Fabric:
        """This rank's routes to the job's coordination: how the adapters agree across ranks, never a collective.

        See :mod:`asymstore.dist.fabric`.
        """
        return self.job.fabric

    # -- global versions -------------------------------------------------

    def global_steps(self) -> list[int]:
        """Published global steps, ascending (reads ``global/``: the coordinator, or a shared filesystem)."""
        return self.job.global_steps()

    def read_global(self, step: int) -> GlobalManifest:
        """Read the global manifest of ``step`` (see :meth:`global_steps`)."""
        return self.job.read_global(step)

    def newest_global(self) -> GlobalManifest | None:
        """The newest global manifest that parses, or None."""
        for step in reversed(self.global_steps()):
            try:
                return self.read_global(step)
            except (GlobalManifestError, OSError) as exc:
                logger.warning("global manifest of step %d unreadable: %s", step, exc)
        return None

    async def agree_step(self, hint: int = 0) -> int:
        """Agree on the step of the next global version (collective: every rank calls it).

        The coordinator picks ``max(hint, newest global step + 1)``; own shards at
        or above it that no global version uses are rolled back when it is put.
        """
        rnd = protocol.AgreeRound(protocol.Wire(self.job.fabric), self._key("agree"))
        if self.is_coordinator:
            newest = max(self.global_steps(), default=-1)
            nonce = await asyncio.to_thread(protocol.next_nonce, self.kv)
            await asyncio.to_thread(rnd.propose, protocol.Agreement(max(hint, newest + 1), newest, nonce))
        agreed = await asyncio.to_thread(rnd.agreed, self.timeout_s)
        self._floor = agreed.floor
        self._commit_tags[agreed.step] = protocol.commit_tag(agreed.step, agreed.nonce)
        return agreed.step

    # -- writing ---------------------------------------------------------

    async def _roll_back(self, step: int) -> None:
        await roll_back(self.local, self.rank, self._floor, step)

    async def put(self, step: int, name: str, tensor: object) -> None:
        """Stage ``tensor`` for ``step`` (see :meth:`asymstore.AsymStore.put`)."""
        await self._roll_back(step)
        await self.local.put(step, name, tensor)

    async def put_many(self, step: int, tensors: Mapping[str, object]) -> None:
        """Stage every tensor of ``tensors`` for ``step``."""
        await self._roll_back(step)
        await self.local.put_many(step, tensors)

    async def adopt(self, step: int, name: str, tensor: object, *,
                    release: Callable[[], None] | None = None) -> None:
        """Stage ``tensor`` itself for ``step`` (see :meth:`asymstore.AsymStore.adopt`)."""
        await self.adopt_many(step, {name: tensor}, release=release)

    async def adopt_many(self, step: int, tensors: Mapping[str, object], *,
                         release: Callable[[], None] | None = None) -> None:
        """Stage ``tensors`` for ``step`` without copying (see :meth:`asymstore.AsymStore.adopt_many`)."""
        try:
            await self._roll_back(step)
        except BaseException:
            if release is not None:
                release()
            raise
        await self.local.adopt_many(step, tensors, release=release)

    def abandon(self, step: int) -> None:
        """Drop everything put for an uncommitted ``step`` (adopted tensors are released)."""
        self.local.abandon(step)

    async def report_dropped(self, step: int, reason: str) -> None:
        """Say that this rank will not commit ``step`` (its version was dropped or skipped).

        The coordinator abandons the step's global commit at once instead of
        waiting for this rank until ``timeout_s`` (:class:`GlobalVersionDroppedError`
        on the ranks that committed it); when the coordinator itself drops it,
        the ranks waiting for the global version are told the same.
        """
        rnd = self._commit_round(step)
        cut = reason[:protocol.REASON_CHARS]
        await asyncio.to_thread(rnd.report, self.rank, protocol.ShardReport(dropped=cut))
        if self.is_coordinator:
            await asyncio.to_thread(rnd.answer, protocol.GlobalAnswer(
                failed=f"step {step}: rank 0 dropped its version ({cut})", dropped=True))

    async def commit(self, step: int, meta: Mapping[str, Any] | None = None, *,
                     summary: Mapping[str, Any] | None = None,
                     global_meta: Mapping[str, Any] | None = None) -> CommitResult:
        """Commit this rank's shard of ``step``, then take part in the global commit.

        Args:
            step: the step; every rank commits the same steps.
            meta: the shard's JSON metadata.
            summary: small JSON copied into this rank's entry of the global manifest.
            global_meta: the global manifest's JSON metadata (the coordinator's is used).

        Returns:
            This rank's commit result (``last_global`` holds the global manifest once known).

        Raises:
            GlobalVersionDroppedError: (coordinator, or any rank with ``wait_global``) a rank dropped
                its version of ``step`` (:meth:`report_dropped`); this rank's shard is committed.
            GlobalCommitTimeoutError: (coordinator, or any rank with ``wait_global``) not every
                rank reported in time; this rank's shard is committed, the global version is not.
            GlobalCommitError: a rank reported that its shard failed.
            LayoutTakeoverError: (every rank, before anything is committed) the root's current versions are
                single-process, and this job neither resumed them (``restore``) nor was given
                ``across_layouts="start_fresh"``; the step's tensors are dropped.
            RootLockedError: the coordinator could not open (see :meth:`open`).
            Everything :meth:`asymstore.AsymStore.commit` raises.
        """
        try:  # every rank alike, before anything is committed
            takeover.check_commit(self.job, await self._layout_verdict(self.timeout_s))
        except AsymstoreError:
            self._commit_tags.pop(step, None)
            self.local.abandon(step)
            raise
        rnd = self._commit_round(step)
        if meta is not None and REPLICAS_KEY in meta:  # slices of a replicated state: the coordinator compares them
            summary = {**(summary or {}), REPLICAS_KEY: meta[REPLICAS_KEY]}
        clean_summary = validate_meta(summary)
        clean_global = validate_meta(global_meta)
        if self.job.rules is not None and self.is_coordinator:  # the decision travels with the global version
            self.job.rules.stamp(step, validate_meta(meta), clean_global)
        try:
            result = await self.local.commit(step, meta)
        except BaseException as exc:
            await asyncio.to_thread(rnd.report, self.rank, protocol.ShardReport(failed=describe(exc)))
            raise
        m = result.manifest
        info = ShardInfo(self.rank, step, shard_digest(m), m.nbytes, len(m.tensors), clean_summary)
        await asyncio.to_thread(rnd.report, self.rank, protocol.ShardReport(info, self.placement))
        self._last_commit = rnd
        if REPLICAS_KEY in clean_summary and not self.is_coordinator and not self.job.replicas_whole:
            await asyncio.to_thread(self._heard_replicas_whole)
        try:
            if self.is_coordinator:
                self.last_global = await asyncio.to_thread(publish_global, self.job, rnd, step, clean_global)
                self.published_step = step
                await retire_departed_shards(self.job)
            elif self.wait_global:
                await asyncio.to_thread(await_global, rnd, step, self.timeout_s)
                self.last_global = None  # published; the manifest itself lives with the coordinator
                self.published_step = step
        except GlobalVersionDroppedError:
            if self.is_coordinator and self.job.replicas_whole:  # every rank writes whole copies from now on
                await asyncio.to_thread(self.job.fabric.announce, self.session_key(REPLICAS_WHOLE), '"1"')
            await self._discard(step)  # no global version will ever use it
            raise
        await retain_shards(self.local, self.job.fabric, self.rank, by_rules=self.job.rules is not None,
                            floor=self._note_floor)
        return result

    @property
    def replicas_whole(self) -> bool:
        """Whether this job fell back to whole copies of its replicated state (see :mod:`asymstore.format.replicas`).

        Set on the coordinator when a sliced version's replicas differed across ranks (it is not
        published), and on every other rank once it hears so, at one of its next commits. A writer
        slicing replicated state must write whole copies once it is set.
        """
        return self.job.replicas_whole

    @property
    def slices_readable(self) -> bool:
        """Whether a restore gets at every rank's slices of a replicated state: a writer may cut them.

        Either every rank reads the other ranks' shards where they are written (the default tiers under
        the root; the coordinator also checks that it sees each rank's shard of the first sliced version
        there, else the job falls back to whole copies), or each rank's tiers are its own and the ranks
        exchange their slices at a restore (``own_tier_slices="exchange"``: :mod:`.sliceexchange`).
        """
        return self.job.shards_under_root or self.job.exchange_slices

    def _heard_replicas_whole(self) -> None:
        """Follow the coordinator's fallback to whole copies (a key of this session in the coordination store)."""
        if self.job.fabric.has(self.session_key(REPLICAS_WHOLE)):
            self.job.replicas_whole = True
            logger.warning("rank %d: the replicas of a sliced version differed across ranks: this job writes "
                           "whole copies of its replicated state from now on", self.rank)

    def _commit_round(self, step: int) -> protocol.CommitRound:
        """The round of this session's commit of ``step`` (tagged with its agreement's nonce, when agreed)."""
        tag = self._commit_tags.pop(step, None) or protocol.commit_tag(step)
        return protocol.CommitRound.of(self.job.fabric, self._session, tag, self.world_size)

    async def _discard(self, step: int) -> None:
        await delete_shard(self.local, step)
        await self.local.refresh()
        for tier in self.local.tiers:  # LATEST must not name a shard that is gone
            left = await tier.list_versions()
            if left:
                await tier.write_latest(max(left))

    @property
    def newest_persistent_step(self) -> int | None:
        """The newest of this rank's shards on a persistent tier (see :meth:`asymstore.AsymStore.flush`)."""
        return self.local.newest_persistent_step

    async def flush(self, timeout_s: float | None = None) -> int | None:
        """Finish this rank's part of its last commit (up to ``timeout_s``), then as ``AsymStore.flush``.

        Collective when several ranks committed (every rank calls it, as at a
        preemption): a non-coordinator waits for the global commit of its last
        shard, drops the shards it made obsolete and says so; the coordinator
        waits until every rank did, so that it (the host of the job's
        coordination store under ``torch.distributed``'s env:// init) outlives
        their use of it. A timeout is logged, never raised.

        Returns:
            The newest step of this rank's shards on a persistent tier; :attr:`published_step` tells
            the newest global version this rank knows was published.
        """
        started = time.monotonic()
        rnd = self._last_commit
        wait = self.timeout_s if timeout_s is None else timeout_s
        if rnd is not None and self.world_size > 1:
            try:
                if self.is_coordinator:
                    await asyncio.to_thread(rnd.wait_flushed, wait, "every rank finishing its last commit")
                else:
                    answer = await asyncio.to_thread(rnd.wait_answer, wait, "the last global commit")
                    if answer.step is not None:
                        self.published_step = answer.step
                        await retain_shards(self.local, self.job.fabric, self.rank,
                                            by_rules=self.job.rules is not None, floor=self._note_floor)
                    await asyncio.to_thread(rnd.flushed, self.rank, protocol.Flushed(answer))
            except (CoordinationTimeoutError, CoordinationProtocolError, RuntimeError) as exc:
                logger.warning("rank %d: its last commit is not finished on every rank: %s", self.rank, exc)
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - started))
        return await self.local.flush(left)

    # -- reading ---------------------------------------------------------

    async def restore(self, step: int | None = None, *, into: Into | None = None) -> Checkpoint:
        """Restore this rank's shard of the newest global version every rank can load (collective).

        See :mod:`.restore` for how the ranks agree.

        Args:
            step: restore exactly this global step.
            into: this rank's tensors to fill in place (see :meth:`asymstore.AsymStore.restore`).

        Raises:
            NoCheckpointError: no global version is published.
            VersionNotFoundError: ``step`` is not published.
            WorldSizeMismatchError: the newest global version was written by another number of ranks
                and ``reshard`` is not set.
            CorruptVersionError: no candidate verified on every rank.
            CoordinationTimeoutError: a rank did not answer in time.
            RootLayoutError: the root's ``LAYOUT.json`` is not valid (every rank raises it); its subclass
                RootLayoutConflictError: the root holds both layouts and no record says which is current.
            RootLockedError: a single-process writer holds the single-process root this job would resume
                (every rank raises it; see :meth:`open`).

        A root with single-process versions and no global version: see ``across_layouts``; such a
        version is read from the root by every rank (``reshard`` set, else ``WorldSizeMismatchError``).
        """
        await self.local.refresh()
        await self._layout_verdict(self.job.restore_timeout_s)  # the coordinator's error at open, on every rank
        try:
            g, ckpt, notes = await restore_collective(self.job, self.local, self.reshard, self._key("restore"), step,
                                                      into)
        except NoCheckpointError:
            # No global version at all (every rank hears the same): this rank's shards, left by a job killed
            # before its first global commit, belong to no version; the steps put from now on replace them.
            self._floor = -1
            raise
        self._restored, self._restored_global = g, g.manifest
        if g.manifest is not None and rootlayout.is_single_root(g.manifest):  # recorded with the layout at the
            self.job.resumed_single = g.step                                   # first global commit
        self._floor = g.shard.step if g.shard is not None else g.step
        if notes:
            logger.warning("restored global step %d after: %s", g.step, "; ".join(notes))
        return Checkpoint(ckpt.step, ckpt.tensors, ckpt.meta, ckpt.tier, ckpt.manifest, [*notes, *ckpt.fallbacks])

    @property
    def restored_global(self) -> GlobalManifest | None:
        """The global version ``restore`` chose (None before one).

        A rank heard only its node's entries of it (:mod:`.restore`): on first use it reads the whole
        manifest from the job's coordination store (one request, where the coordinator put it), checked
        against the digest the coordinator sent (:class:`~asymstore.errors.CoordinationProtocolError`
        when it differs).
        """
        if self._restored_global is None and self._restored is not None:
            self._restored_global = whole_manifest(self.kv, self._restored)
        return self._restored_global

    @restored_global.setter
    def restored_global(self, g: GlobalManifest | None) -> None:
        self._restored_global, self._restored = g, None

    async def read_shard(self, rank: int, step: int) -> Checkpoint:
        """Read and verify another rank's shard (through ``peer_tiers``; own shards through this store)."""
        if rank == self.rank:
            return await self.local.restore(step=step)
        return await read_peer_shard(self.job.peer_tiers(rank), rank, step)

    async def read_shard_manifest(self, rank: int, step: int) -> Manifest:
        """Read another rank's shard manifest (its meta tells what the shard holds)."""
        if rank == self.rank:
            return await read_shard_manifest(self.tiers, rank, step, opened=True)
        return await read_shard_manifest(self.job.peer_tiers(rank), rank, step, opened=False)

    async def read_manifest(self, step: int | None = None) -> Manifest:
        """This rank's shard manifest of the newest published global version (or of global ``step``); not collective.

        No tensor is read. A rank beyond the version's world reads rank 0's shard manifest.

        Raises:
            NoCheckpointError: no global version is published (or none parses).
            VersionNotFoundError: ``step`` is not published.
            CorruptVersionError: no tier holds the shard's manifest.
        """
        from asymstore.errors import VersionNotFoundError

        if step is None:
            g = self.newest_global()
            if g is None:
                raise NoCheckpointError("no global version is published")
        elif step not in self.global_steps():
            raise VersionNotFoundError(f"global step {step} is not published")
        else:
            g = self.read_global(step)
        rank = self.rank if self.rank < g.world_size else 0
        return await self.read_shard_manifest(rank, g.shard(rank).step)


_SATISFIES: type[CheckpointStore] = RankStore  # mypy checks that RankStore satisfies the adapters' protocol
