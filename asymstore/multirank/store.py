"""RankStore: one rank's shard store of a multi-rank checkpoint, with a two-phase global commit.

Protocol (see :mod:`asymstore.multirank.layout` for the directories):

1. every rank commits its shard of step ``s`` to its own tiers (an ordinary
   :class:`~asymstore.AsymStore` commit: durable before it returns);
2. it reports the shard (step, tier-independent digest, size) under a key of
   the job's c10d store;
3. the coordinator (rank 0) waits for every rank's report, with a timeout,
   then publishes ``global/v…s.json`` atomically and updates ``global/LATEST``.
   Only then does the multi-rank version exist.

Waiting happens on the store's own event loop thread (never the training
thread) and only through the key-value store: never a collective on the
training process group. A rank that dies or times out leaves no global
manifest, so the previous global version stays the newest restorable one; its
orphan shards are reported ``partial`` by fsck and rolled back when the same
step is committed again after a restore.

``restore`` is collective (every rank calls it): the coordinator picks the
newest global version whose shards every rank holds, every rank loads and
verifies its shard against the digest, and a version that fails on any rank
is skipped for the one before, on every rank alike.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asymstore.checksum import checksum
from asymstore.errors import (
    AsymstoreError,
    CorruptVersionError,
    NoCheckpointError,
    VersionNotFoundError,
)
from asymstore.manifest import Manifest, validate_meta
from asymstore.multirank import layout
from asymstore.multirank.departed import retire_departed
from asymstore.multirank.errors import (
    CoordinationTimeoutError,
    GlobalCommitError,
    GlobalCommitTimeoutError,
    GlobalManifestError,
    WorldSizeMismatchError,
)
from asymstore.multirank.globalmanifest import GlobalManifest, ShardInfo, shard_digest
from asymstore.multirank.kv import KV, MemoryStore, store_from_env
from asymstore.multirank.reshardread import Targets, restore_resharded
from asymstore.restore import Checkpoint, describe, load_version, read_manifest
from asymstore.rootlock import DirLock, sweep_directory
from asymstore.store import AsymStore, CommitResult
from asymstore.tiers.base import Tier
from asymstore.tiers.local import LocalTier

if TYPE_CHECKING:

    from asymstore.load import Into

logger = logging.getLogger(__name__)

_ERRORS: dict[str, type[AsymstoreError]] = {
    "NoCheckpointError": NoCheckpointError,
    "VersionNotFoundError": VersionNotFoundError,
    "WorldSizeMismatchError": WorldSizeMismatchError,
    "CorruptVersionError": CorruptVersionError,
}


def _env_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        env = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        import torch.distributed as dist

        env = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    return (env[0] if rank is None else rank), (env[1] if world_size is None else world_size)


class RankStore(AsymStore):
    """This rank's store of a multi-rank checkpoint under ``root`` (see the module docstring).

    Use it wherever an :class:`~asymstore.AsymStore` goes (e.g. as the store
    of :class:`asymcheck.Checkpointer` under DDP). Every rank must commit the
    same steps, and every rank must call ``restore``.

    Args:
        root: the multi-rank root (shared by all ranks; the coordinator writes ``global/`` there).
        rank: this rank (default: ``RANK`` from the environment, or torch.distributed).
        world_size: the number of ranks (default: ``WORLD_SIZE``, or torch.distributed).
        tiers: this rank's tiers, fastest first (default: ``LocalTier(root/rank-NNNNN)``).
        peer_tiers: rank -> tiers to read another rank's shards (default: its ``LocalTier``).
        kv: a ``torch.distributed.Store`` for coordination (default: a new TCPStore client
            to ``MASTER_ADDR:MASTER_PORT`` when ``world_size > 1``).
        keep_last: global versions kept; shards no kept version needs are deleted. None keeps all.
        timeout_s: how long the coordinator waits for every rank's report at a commit
            (and ranks with ``wait_global`` for the coordinator).
        restore_timeout_s: how long ranks wait for each other during ``restore``.
        wait_global: non-coordinator ranks return from ``commit`` only once the global
            version is published (the coordinator always waits).
        namespace: key prefix in the c10d store (default: derived from ``root``).
        fsync: flush files and directories (the default tiers and the global directory).
        **store_kwargs: passed to :class:`~asymstore.AsymStore` (``segment_bytes``, ``compression``...).
    """

    def __init__(self, root: str | os.PathLike[str], *, rank: int | None = None, world_size: int | None = None,
                 tiers: Sequence[Tier] | None = None, peer_tiers: Callable[[int], Sequence[Tier]] | None = None,
                 kv: Any = None, keep_last: int | None = 3, timeout_s: float = 300.0,
                 restore_timeout_s: float = 1800.0, wait_global: bool = False, namespace: str | None = None,
                 fsync: bool = True, **store_kwargs: Any) -> None:
        """Configure; nothing is opened before ``open``."""
        self.rank, self.world_size = _env_rank_world(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep everything)")
        self.root = os.path.abspath(os.fspath(root))
        self.global_dir = os.path.join(self.root, layout.GLOBAL_DIR)
        self._global_lock = DirLock(self.global_dir)
        self.fsync = fsync
        self._peer_tiers = peer_tiers or (lambda r: [LocalTier(os.path.join(self.root, layout.rank_dirname(r)),
                                                               fsync=fsync)])
        if tiers is None:
            tiers = self._peer_tiers(self.rank)
        super().__init__(tiers, keep_last=None, **store_kwargs)
        self.global_keep_last = keep_last
        self.timeout_s = timeout_s
        self.restore_timeout_s = restore_timeout_s
        self.wait_global = wait_global
        self.namespace = namespace or checksum(self.root.encode())[:12]
        self._kv_given = kv
        self._kv: KV | None = None
        self._session = 0
        self._counters: dict[str, int] = {}
        self._floor: int | None = None  # own shards above this step may be rolled back
        self._commit_tags: dict[int, str] = {}
        self._last_commit_key: str | None = None
        self.last_global: GlobalManifest | None = None
        """The newest global version this rank saw published (the coordinator's, after each commit)."""
        self.restored_global: GlobalManifest | None = None
        """The global version ``restore`` chose."""
        self.published_step: int | None = None
        """The newest global step this rank saw published (its commits; non-coordinators: once waited for)."""
        self.reshard: Targets | None = None
        """Set it to restore versions written by another number of ranks (see :mod:`.reshardread`)."""

    def peer_tiers(self, rank: int) -> Sequence[Tier]:
        """Unopened tiers to read ``rank``'s shards from."""
        return self._peer_tiers(rank)

    @property
    def is_coordinator(self) -> bool:
        """True on rank 0, which publishes global manifests."""
        return self.rank == 0

    # -- lifecycle -------------------------------------------------------

    async def open(self) -> RankStore:
        """Open the tiers, connect to the coordination store, and create ``global/`` (coordinator)."""
        if self._kv is None:
            if self._kv_given is not None:
                self._kv = KV(self._kv_given)
            elif self.world_size == 1:
                self._kv = KV(MemoryStore())
            else:
                self._kv = KV(await asyncio.to_thread(store_from_env, self.namespace, timeout_s=self.timeout_s))
        self._session = await asyncio.to_thread(self._kv.store.add, f"session/{self.rank}", 1)
        if self.is_coordinator:  # the only writer of global/: lock it, then sweep what a dead coordinator left
            await asyncio.to_thread(os.makedirs, self.global_dir, exist_ok=True)
            await asyncio.to_thread(self._global_lock.acquire)
            await asyncio.to_thread(sweep_directory, self.global_dir, fsync=self.fsync)
        try:
            await super().open()
        except BaseException:
            self._global_lock.release()
            raise
        return self

    async def close(self) -> None:
        """Close; a non-coordinator first waits briefly for its last global commit and drops shards it made obsolete."""
        if self._kv is not None and self._last_commit_key is not None and not self.is_coordinator:
            try:
                await asyncio.to_thread(self._kv.wait, [f"{self._last_commit_key}/global"],
                                        min(self.timeout_s, 30.0), "the last global commit")
                await self._retain_shards()
            except (CoordinationTimeoutError, RuntimeError) as exc:
                logger.info("rank %d closing without the last global commit: %s", self.rank, exc)
            self._last_commit_key = None
        try:
            await super().close()
        finally:
            self._global_lock.release()

    def _key(self, kind: str) -> str:
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        return f"s{self._session}/{kind}/{n}"

    @property
    def kv(self) -> KV:
        """The coordination store (after ``open``)."""
        if self._kv is None:
            raise RuntimeError("the RankStore is not open")
        return self._kv

    # -- global versions -------------------------------------------------

    def global_steps(self) -> list[int]:
        """Published global steps, ascending (reads ``global/``: the coordinator, or a shared filesystem)."""
        return layout.list_global_steps(self.global_dir)

    def read_global(self, step: int) -> GlobalManifest:
        """Read the global manifest of ``step`` (see :meth:`global_steps`)."""
        return layout.read_global(self.global_dir, step)

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
        key = self._key("agree")
        kv = self.kv
        if self.is_coordinator:
            newest = max(self.global_steps(), default=-1)
            nonce = await asyncio.to_thread(kv.store.add, "nonce", 1)
            await asyncio.to_thread(kv.put, key, {"step": max(hint, newest + 1), "floor": newest, "nonce": nonce})
        await asyncio.to_thread(kv.wait, [key], self.timeout_s, "agreeing on the next step")
        msg = await asyncio.to_thread(kv.get, key)
        step = int(msg["step"])
        self._floor = int(msg["floor"])
        self._commit_tags[step] = f"{step}.{msg['nonce']}"
        return step

    # -- writing ---------------------------------------------------------

    async def _roll_back(self, step: int) -> None:
        """Delete own shards at or above ``step`` that no global version can use (after a restore)."""
        newest = self.newest_step
        if self._floor is None or newest is None or newest < step:
            return
        victims = [s for s in sorted({v for vs in self.versions().values() for v in vs}) if s >= step > self._floor]
        for s in victims:
            logger.warning("rank %d: rolling back shard %d (no global version uses it)", self.rank, s)
            await self._delete_shard(s)
        await self.refresh()
        for tier in self.tiers:  # LATEST must not name a shard that is gone
            left = await tier.list_versions()
            if left:
                await tier.write_latest(max(left))

    async def _delete_shard(self, step: int) -> None:
        for tier in self.tiers:
            if step in await tier.list_versions():
                await tier.delete_version(step)

    async def put(self, step: int, name: str, tensor: object) -> None:
        """Stage ``tensor`` for ``step`` (see :meth:`asymstore.AsymStore.put`)."""
        await self._roll_back(step)
        await super().put(step, name, tensor)

    async def put_many(self, step: int, tensors: Mapping[str, object]) -> None:
        """Stage every tensor of ``tensors`` for ``step``."""
        await self._roll_back(step)
        await super().put_many(step, tensors)

    async def adopt_many(self, step: int, tensors: Mapping[str, object], *,
                         release: Callable[[], None] | None = None) -> None:
        """Stage ``tensors`` for ``step`` without copying (see :meth:`asymstore.AsymStore.adopt_many`)."""
        try:
            await self._roll_back(step)
        except BaseException:
            if release is not None:
                release()
            raise
        await super().adopt_many(step, tensors, release=release)

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
            GlobalCommitTimeoutError: (coordinator, or any rank with ``wait_global``) not every
                rank reported in time; this rank's shard is committed, the global version is not.
            GlobalCommitError: a rank reported that its shard failed.
            Everything :meth:`asymstore.AsymStore.commit` raises.
        """
        kv = self.kv
        key = f"s{self._session}/commit/{self._commit_tags.pop(step, str(step))}"
        clean_summary = validate_meta(summary)
        clean_global = validate_meta(global_meta)
        try:
            result = await super().commit(step, meta)
        except BaseException as exc:
            await asyncio.to_thread(kv.put, f"{key}/rank/{self.rank}", {"failed": describe(exc)})
            raise
        m = result.manifest
        info = ShardInfo(self.rank, step, shard_digest(m), m.nbytes, len(m.tensors), clean_summary)
        await asyncio.to_thread(kv.put, f"{key}/rank/{self.rank}", info.to_json())
        self._last_commit_key = key
        if self.is_coordinator:
            self.last_global = await asyncio.to_thread(self._publish, key, step, clean_global)
            await self._retire_departed()
        elif self.wait_global:
            await asyncio.to_thread(self._await_global, key, step)
        await self._retain_shards()
        return result

    def _publish(self, key: str, step: int, meta: dict[str, Any]) -> GlobalManifest:
        kv = self.kv
        keys = [f"{key}/rank/{r}" for r in range(self.world_size)]
        try:
            kv.wait(keys, self.timeout_s, f"global commit of step {step}")
        except CoordinationTimeoutError as exc:
            missing = [r for r, k in enumerate(keys) if not kv.has(k)]
            msg = (f"step {step}: rank(s) {missing} did not report a committed shard within {self.timeout_s:g} s; "
                   f"the global version is not published (newest stays {max(self.global_steps(), default=None)})")
            kv.put(f"{key}/global", {"failed": msg})
            raise GlobalCommitTimeoutError(msg) from exc
        reports = [kv.get(k) for k in keys]
        failed = {r: rep["failed"] for r, rep in enumerate(reports) if "failed" in rep}
        if failed:
            msg = f"step {step}: shard commit failed on rank(s) {failed}; the global version is not published"
            kv.put(f"{key}/global", {"failed": msg})
            raise GlobalCommitError(msg)
        manifest = GlobalManifest(step, self.world_size, tuple(ShardInfo.from_json(r) for r in reports), meta,
                                  time.time())
        layout.publish_global(self.global_dir, manifest, fsync=self.fsync)
        layout.write_global_latest(self.global_dir, step, fsync=self.fsync)
        self._retain_globals()
        kv.put(f"{key}/global", {"step": step})
        self.published_step = step
        logger.debug("published global version %d (%d ranks, %d bytes)", step, self.world_size, manifest.nbytes)
        return manifest

    def _await_global(self, key: str, step: int) -> None:
        try:
            self.kv.wait([f"{key}/global"], self.timeout_s, f"the coordinator's global commit of step {step}")
        except CoordinationTimeoutError as exc:
            raise GlobalCommitTimeoutError(str(exc)) from exc
        msg = self.kv.get(f"{key}/global")
        if "failed" in msg:
            raise GlobalCommitError(msg["failed"])
        self.last_global = None  # published; the manifest itself lives with the coordinator
        self.published_step = step

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
        key = self._last_commit_key
        wait = self.timeout_s if timeout_s is None else timeout_s
        if key is not None and self.world_size > 1:
            try:
                if self.is_coordinator:
                    await asyncio.to_thread(self.kv.wait, [f"{key}/flushed/{r}" for r in range(1, self.world_size)],
                                            wait, "every rank finishing its last commit")
                else:
                    await asyncio.to_thread(self.kv.wait, [f"{key}/global"], wait, "the last global commit")
                    msg = await asyncio.to_thread(self.kv.get, f"{key}/global")
                    if "step" in msg:
                        self.published_step = int(msg["step"])
                        await self._retain_shards()
                    await asyncio.to_thread(self.kv.put, f"{key}/flushed/{self.rank}", {"global": msg})
            except (CoordinationTimeoutError, RuntimeError) as exc:
                logger.warning("rank %d: its last commit is not finished on every rank: %s", self.rank, exc)
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - started))
        return await super().flush(left)

    def _retain_globals(self) -> None:
        """Coordinator: drop global versions beyond ``keep_last``; tell each rank which shards are still needed."""
        if self.global_keep_last is None:
            return
        steps = self.global_steps()
        for old in steps[:-self.global_keep_last]:
            layout.delete_global(self.global_dir, old, fsync=self.fsync)
        kept = []
        for s in steps[-self.global_keep_last:]:
            try:
                kept.append(self.read_global(s))
            except (GlobalManifestError, OSError):
                continue
        if not kept:
            return
        for r in range(self.world_size):  # a kept version of another world size may need rank r's older shards
            steps_r = [g.shard(r).step for g in kept if r < g.world_size]
            if steps_r:
                self.kv.raise_int(f"retain/{r}", min(steps_r) + 1)

    async def _retire_departed(self) -> None:
        """Coordinator: drop shards of ranks no longer in the job (it shrank) that no kept version needs."""
        if self.global_keep_last is None or not any(r >= self.world_size for r in layout.rank_dirs(self.root)):
            return
        kept = []
        for s in self.global_steps()[-self.global_keep_last:]:
            try:
                kept.append(self.read_global(s))
            except (GlobalManifestError, OSError):
                return  # an unreadable kept version: delete nothing it might need
        await retire_departed(self.root, self.world_size, kept, self._peer_tiers)

    async def _retain_shards(self) -> None:
        """Delete own shards older than the oldest one a kept global version needs."""
        keep_from = await asyncio.to_thread(self.kv.read_int, f"retain/{self.rank}") - 1
        if keep_from < 0:
            return
        old = sorted({v for vs in self.versions().values() for v in vs if v < keep_from})
        for s in old:
            await self._delete_shard(s)
        if old:
            await self.refresh()

    # -- reading ---------------------------------------------------------

    async def restore(self, step: int | None = None, *, into: Into | None = None) -> Checkpoint:
        """Restore this rank's shard of the newest global version every rank can load (collective).

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
        """
        await self.refresh()
        key = self._key("restore")
        if self.is_coordinator:
            haves = await asyncio.to_thread(self._gather_haves, key)
            return await self._restore_coordinator(key, haves, step, into)
        have = sorted({v for vs in self.versions().values() for v in vs})
        await asyncio.to_thread(self.kv.put, f"{key}/have/{self.rank}", have)
        return await self._restore_follower(key, into)

    def _gather_haves(self, key: str) -> dict[int, set[int]]:
        own = sorted({v for vs in self.versions().values() for v in vs})
        self.kv.put(f"{key}/have/{self.rank}", own)
        keys = [f"{key}/have/{r}" for r in range(self.world_size)]
        self.kv.wait(keys, self.restore_timeout_s, "ranks listing their shards for restore")
        return {r: set(self.kv.get(k)) for r, k in enumerate(keys)}

    def _candidates(self, haves: dict[int, set[int]], step: int | None,
                    notes: list[str]) -> list[GlobalManifest]:
        steps = sorted(self.global_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                raise VersionNotFoundError(f"global step {step} is not published under {self.global_dir}")
            steps = [step]
        if not steps:
            raise NoCheckpointError(f"no global version under {self.global_dir}")
        out: list[GlobalManifest] = []
        for s in steps:
            try:
                g = self.read_global(s)
            except (GlobalManifestError, OSError) as exc:
                notes.append(f"global step {s}: {describe(exc)}")
                continue
            if g.world_size != self.world_size and self.reshard is not None:
                out.append(g)  # read from every old rank's shard (reshardread), not from this rank's own
                continue
            if g.world_size != self.world_size:
                if not out:
                    raise WorldSizeMismatchError(
                        f"global step {s} was written by {g.world_size} rank(s); this job has {self.world_size}. "
                        "Restore needs the same world size, or resharding (RankStore.reshard)")
                continue
            lacking = [r for r in range(self.world_size) if g.shard(r).step not in haves[r]]
            if lacking:
                notes.append(f"global step {s}: rank(s) {lacking} do not hold their shard")
                continue
            out.append(g)
        return out

    async def _restore_coordinator(self, key: str, haves: dict[int, set[int]], step: int | None,
                                   into: Into | None) -> Checkpoint:
        kv = self.kv
        notes: list[str] = []
        try:
            candidates = self._candidates(haves, step, notes)
        except (NoCheckpointError, WorldSizeMismatchError) as exc:
            await asyncio.to_thread(kv.put, f"{key}/try/0", {"error": type(exc).__name__, "message": str(exc)})
            raise
        for k, g in enumerate(candidates):
            await asyncio.to_thread(kv.put, f"{key}/try/{k}", {"global": g.to_json().decode()})
            ckpt, reason = await self._try_shard(g, into)
            await asyncio.to_thread(kv.put, f"{key}/result/{k}/{self.rank}", {"ok": ckpt is not None, "reason": reason})
            keys = [f"{key}/result/{k}/{r}" for r in range(self.world_size)]
            await asyncio.to_thread(kv.wait, keys, self.restore_timeout_s, f"ranks loading global step {g.step}")
            results = [await asyncio.to_thread(kv.get, kk) for kk in keys]
            bad = {r: res["reason"] for r, res in enumerate(results) if not res["ok"]}
            if not bad and ckpt is not None:
                await asyncio.to_thread(kv.put, f"{key}/try/{k + 1}", {"done": g.step, "notes": notes})
                return self._restored(g, ckpt, notes)
            notes.append(f"global step {g.step}: failed on rank(s) {bad}")
            logger.warning("restore: global step %d failed on rank(s) %s; trying the one before", g.step, sorted(bad))
        msg = "no global version verified on every rank: " + "; ".join(notes)
        await asyncio.to_thread(kv.put, f"{key}/try/{len(candidates)}",
                                {"error": "CorruptVersionError", "message": msg})
        raise CorruptVersionError(msg)

    async def _restore_follower(self, key: str, into: Into | None) -> Checkpoint:
        kv = self.kv
        k = 0
        ckpt: Checkpoint | None = None
        g: GlobalManifest | None = None
        while True:
            await asyncio.to_thread(kv.wait, [f"{key}/try/{k}"], self.restore_timeout_s, "the coordinator's restore")
            msg = await asyncio.to_thread(kv.get, f"{key}/try/{k}")
            if "error" in msg:
                raise _ERRORS.get(msg["error"], CorruptVersionError)(msg["message"])
            if "done" in msg:
                assert ckpt is not None and g is not None and g.step == msg["done"]
                return self._restored(g, ckpt, list(msg.get("notes", [])))
            g = GlobalManifest.from_json(msg["global"].encode())
            ckpt, reason = await self._try_shard(g, into)
            await asyncio.to_thread(kv.put, f"{key}/result/{k}/{self.rank}", {"ok": ckpt is not None, "reason": reason})
            k += 1

    async def _try_shard(self, g: GlobalManifest,
                         into: Into | None) -> tuple[Checkpoint | None, str]:
        if g.world_size != self.world_size and self.reshard is not None:
            try:
                return await restore_resharded(self, g, self.reshard), ""
            except (AsymstoreError, OSError) as exc:
                return None, describe(exc)
        shard = g.shard(self.rank)
        try:
            ckpt = await AsymStore.restore(self, step=shard.step, into=into)
        except (AsymstoreError, OSError) as exc:
            return None, describe(exc)
        digest = shard_digest(ckpt.manifest)
        if digest != shard.digest:
            return None, f"shard {shard.step} digest {digest} != {shard.digest} in the global manifest"
        return ckpt, ""

    def _restored(self, g: GlobalManifest, ckpt: Checkpoint, notes: list[str]) -> Checkpoint:
        self.restored_global = g
        self._floor = g.shard(self.rank).step if self.rank < g.world_size else g.step
        if notes:
            logger.warning("restored global step %d after: %s", g.step, "; ".join(notes))
        return Checkpoint(ckpt.step, ckpt.tensors, ckpt.meta, ckpt.tier, ckpt.manifest, [*notes, *ckpt.fallbacks])

    async def read_shard(self, rank: int, step: int) -> Checkpoint:
        """Read and verify another rank's shard (through ``peer_tiers``; own shards through this store)."""
        if rank == self.rank:
            return await AsymStore.restore(self, step=step)
        reasons: list[str] = []
        for tier in self._peer_tiers(rank):
            await tier.open()
            try:
                manifest, tensors = await load_version(tier, step)
                return Checkpoint(step, tensors, manifest.meta, tier.name, manifest, reasons)
            except (AsymstoreError, OSError) as exc:
                reasons.append(f"rank {rank} step {step} on {tier.name}: {describe(exc)}")
            finally:
                await tier.close()
        raise CorruptVersionError("; ".join(reasons) or f"no tier of rank {rank}")

    async def read_shard_manifest(self, rank: int, step: int) -> Manifest:
        """Read another rank's shard manifest (its meta tells what the shard holds)."""
        reasons: list[str] = []
        for tier in self._peer_tiers(rank) if rank != self.rank else self.tiers:
            if rank != self.rank:
                await tier.open()
            try:
                return await read_manifest(tier, step)
            except (AsymstoreError, OSError) as exc:
                reasons.append(f"rank {rank} step {step} on {tier.name}: {describe(exc)}")
            finally:
                if rank != self.rank:
                    await tier.close()
        raise CorruptVersionError("; ".join(reasons) or f"no tier of rank {rank}")
