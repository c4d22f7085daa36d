"""``StorageWriter``: ``dcp.save`` / ``dcp.async_save`` into asymstore versions.

Each save is one version: the store is built and opened on the first save, on the writer's own
loop thread (:class:`asymstore.runtime.loop.StoreLoop`); ``write_data`` chooses the step (a
:class:`~asymstore.multirank.RankStore` agrees on it through the job's key-value store), copies
the resolved items in batches of :data:`BATCH_BYTES` (adopts, without a copy, those a stager lent:
:mod:`asymstore.dcp.lent`) and commits the shards of the ranks other
than the coordinator; ``finish`` stores DCP's metadata as strict JSON (:mod:`asymstore.dcp.metadata`)
and commits the version, which exists only then.

Guide (DCP's call order and what each call does here): ``docs/guides/dcp.md``.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from asymstore.dcp import metadata as md
from asymstore.dcp import session as shared
from asymstore.dcp.lent import is_lent
from asymstore.dcp.session import Save as _Save
from asymstore.dcp.session import Session
from asymstore.dcp.spec import StoreSpec, own_store, parse_step, renamed_location
from asymstore.errors import DCPStorageError, InvalidNameError, StepCommittedError, StepOrderError
from asymstore.format.manifest import validate_name
from asymstore.multirank.store import RankStore
from asymstore.store import AsymStore
from asymstore.values import CommitResult

logger = logging.getLogger(__name__)

T = TypeVar("T")

BATCH_BYTES = 64 << 20
"""Resolved items are copied into the store in batches of about this many bytes."""

_DCP_VERSION: str = getattr(importlib.import_module("torch.distributed.checkpoint.filesystem"), "CURRENT_DCP_VERSION",
                            "1.0.0")
"""The DCP format version DCP's own writer records (``Metadata.version``)."""


class StorageWriter(_DCPStorageWriter):
    """A ``torch.distributed.checkpoint.StorageWriter`` whose every save is an asymstore version.

    ::

        writer = StorageWriter("ckpt")                    # or tiers, an AsymStore, a RankStore
        dcp.save(state_dict, storage_writer=writer)       # a new version: the next step
        dcp.save(state_dict, storage_writer=writer, checkpoint_id="step-12")   # this step
        writer.close()                                    # waits for background tiers

    Each save is committed as one version: manifests, chunk checksums, an
    atomic publish on each tier, retention (``keep_last``), the background
    cascade to slower tiers, and ``python -m asymstore.fsck`` on the result. In
    a job of several ranks each rank writes its own shard of a
    :class:`~asymstore.multirank.RankStore` (built from a directory, or given)
    and the coordinator publishes the global manifest once every rank's shard
    is committed. :class:`~asymstore.dcp.StorageReader` reads the versions
    back, with DCP's resharding. ``dcp.async_save`` works too (DCP stages a
    CPU copy, then runs the save on a thread of its own): one save at a time
    per writer, so wait for the previous future before the next save.

    No pickle is used: DCP's metadata is stored as strict JSON (see
    :mod:`asymstore.dcp.metadata`). Two things are DCP's own and opaque here:
    the bytes of non-tensor values, which DCP's default planner serializes with
    ``torch.save`` (and loads with ``torch.load(weights_only=False)``; they are
    stored and checksummed like any tensor and handed back only verified), and,
    only with ``pickle_planner_data=True``, a custom planner's data that strict
    JSON cannot hold (pickled into a checksummed tensor; a reader must opt in to
    unpickle it).

    Args:
        location: where the checkpoint lives (formerly ``store_or_tiers``, still accepted with a
            ``DeprecationWarning``): an :class:`~asymstore.AsymStore` or
            :class:`~asymstore.multirank.RankStore` that is not open yet (the
            writer opens it on its own event loop thread and closes it in
            :meth:`close`), a list of tiers (fastest first), a directory or a tier
            URI. With several ranks a directory becomes each rank's
            ``RankStore`` (``root/rank-NNNNN`` plus ``root/global``); a list of tiers
            or a URI is refused there (give each rank a ``RankStore`` with its tiers).
        keep_last: versions kept by a store built here (None keeps all).
        pickle_planner_data: store a custom planner's data that strict JSON cannot
            hold pickled (default: refuse such a save with :class:`~asymstore.errors.DCPStorageError`).
        **store_kwargs: options of the store built here (``segment_bytes``, ``compression``...).

    Raises:
        DCPStorageError: store options beside a store object; another kind of store.
    """

    def __init__(self, location: StoreSpec | None = None, *, keep_last: int | None = 3,
                 pickle_planner_data: bool = False, **store_kwargs: Any) -> None:
        """Configure; nothing is opened before the first save (or :meth:`open`)."""
        super().__init__()
        spec: StoreSpec = renamed_location(location, store_kwargs, "store_or_tiers", "StorageWriter")
        if isinstance(spec, (AsymStore, RankStore)) and store_kwargs:
            raise DCPStorageError(f"store options {sorted(store_kwargs)} go to the store itself, not beside it")
        self._spec = spec
        self.keep_last = keep_last
        self.pickle_planner_data = pickle_planner_data
        self._store_kwargs = store_kwargs
        self._session: Session | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._open_lock = threading.Lock()
        self._closed = False
        self._requested: int | None = None
        self.last_step: int | None = None
        """The step of the last save this writer committed (None before one)."""
        self.last_commit: CommitResult | None = None
        """What the store's commit of the last save returned (this rank's shard under a RankStore)."""

    # -- lifecycle ---------------------------------------------------------

    def open(self) -> AsymStore | RankStore:
        """Build and open the store now (the first save does it otherwise); return it.

        The writers of one process that name the same directory or URI share one open store (and
        one save at a time, as one writer would): a new writer per save, DCP's idiom, meets no lock
        of its own process (see :mod:`asymstore.dcp.session`).

        Raises:
            DCPStorageError: the writer is closed, the store cannot be built for this job, or the
                root is open in this process by a writer with other options.
            RootLockedError: another process (or a store that is not a StorageWriter's) writes the directory.
        """
        return self._open_session().loop.store

    def _open_session(self) -> Session:
        with self._open_lock:
            if self._closed:
                raise DCPStorageError("the StorageWriter is closed")
            if self._session is not None:
                return self._session

            def build() -> AsymStore | RankStore:
                store = own_store(self._spec, self.keep_last, self._store_kwargs, read_only=False)
                assert not isinstance(store, str), "a writer always gets a store"
                return store
            session = shared.acquire(shared.shared_key(self._spec), (self.keep_last, dict(self._store_kwargs)),
                                     build, "asymstore-dcp-writer")
            self._session = session
            # dropped without close() (DCP's idiom): let go of the shared store, closing nothing
            self._finalizer = weakref.finalize(self, shared.release, session, close=False)
            return session

    @property
    def store(self) -> AsymStore | RankStore:
        """The store (built and opened on first use)."""
        return self.open()

    def run_on_store(self, coro: Any) -> Any:
        """Run a coroutine on the store's loop thread (how a reader sharing this writer's store reads)."""
        return self._open_session().loop.run(coro)

    def close(self) -> None:
        """Close the store (waits for its background tiers) and stop its loop thread; idempotent.

        A store shared with other writers of the same root in this process closes with the last of them;
        closing a writer that never opened closes the store its root's dropped writers left open, if no
        live writer holds it (``StorageWriter(root).close()`` after DCP's idiom).
        """
        with self._open_lock:
            self._closed = True
            session, self._session = self._session, None
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if session is not None:
            shared.release(session, close=True)
        else:
            shared.close_idle(shared.shared_key(self._spec))

    def __enter__(self) -> StorageWriter:
        """Return the writer (opened at its first save)."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close the writer."""
        self.close()

    def _run(self, coro: Any) -> Any:
        assert self._session is not None, "opened in set_up_storage_writer"
        return self._session.loop.run(coro)

    # -- the StorageWriter interface ---------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Take ``checkpoint_id`` (when given) as the step of the next save.

        Raises:
            DCPStorageError: ``checkpoint_id`` names no step.
        """
        self._requested = None if checkpoint_id is None else parse_step(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a step (see :func:`~asymstore.dcp.spec.parse_step`)."""
        try:
            parse_step(checkpoint_id)
        except DCPStorageError:
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        """DCP's storage metadata of the next save (a save id)."""
        return StorageMeta(save_id=uuid.uuid4().hex)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Open the store (first save), drop what an unfinished earlier save left, and start this save.

        Raises:
            DCPStorageError: ``use_collectives=False``; a rank other than the
                coordinator with a single-process store; a RankStore of another rank.
        """
        if not kwargs.get("use_collectives", True):
            raise DCPStorageError("use_collectives=False is not supported: a version is published by the "
                                  "coordinator once every rank's shard is committed")
        session = self._open_session()
        store = session.loop.store
        rank = int(kwargs.get("rank") or 0)
        if isinstance(store, RankStore):
            if store.rank != rank:
                raise DCPStorageError(f"DCP's rank {rank} is rank {store.rank} of the RankStore: save with the "
                                      "process group the RankStore's ranks are numbered in")
        elif rank != 0 or not is_coordinator:
            raise DCPStorageError("several ranks cannot share one AsymStore: give each rank a RankStore (or a "
                                  "directory, which becomes one)")
        with session.lock:  # the previous save of this root: this writer's, or another writer's of it
            previous = list(session.saves.values())
            session.saves = {threading.get_ident(): _Save(rank, is_coordinator, self._requested, uuid.uuid4().hex)}
        self._requested = None
        for save in previous:
            if not save.done:
                save.superseded = True  # it can no longer stage or commit (checked on the loop thread)
                if save.step is not None:
                    logger.warning("dropping step %d: its save did not finish before the next one began", save.step)
                self._abandon(save)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Return ``plan`` unchanged (items are named and located in ``write_data``)."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Check that the plans come from the store's ranks; return them unchanged.

        Raises:
            DCPStorageError: the save runs on another number of ranks than the store's.
        """
        store = self.open()
        world = store.world_size if isinstance(store, RankStore) else 1
        if len(plans) != world:
            raise DCPStorageError(f"the save runs on {len(plans)} ranks, the store is "
                                  f"{'a RankStore of ' + str(world) + ' ranks' if world > 1 else 'single-process'}")
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Choose the step, copy every item of ``plan`` into the store, and commit (ranks but the coordinator).

        Raises:
            StepOrderError, StepCommittedError: the requested step is not newer than the newest version.
            InvalidValueError: an item is a tensor of a dtype the store cannot hold.
            AsymstoreError: the store refused the version (the previous one is untouched).
        """
        save = self._mine()
        store = self.open()
        try:
            save.step = self._call(save, lambda: self._choose_step(store, save))
            session = self._open_session()
            session.last_chosen = max(save.step, session.last_chosen or 0)
            results = self._stage(store, save, plan, planner)
            if isinstance(store, RankStore) and not save.coordinator:
                step, meta = save.step, self._shard_meta(store, save, len(results))
                self.last_commit = self._call(save, lambda: store.commit(step, meta))
                self._finished(save)
        except BaseException:
            self._abandon(save)
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Store the metadata as strict JSON and commit the version (the coordinator; see the module docstring).

        Raises:
            DCPStorageError: planner data strict JSON cannot hold (without ``pickle_planner_data``).
            GlobalCommitError: (RankStore) not every rank committed its shard; no version is published.
            AsymstoreError: the store refused the version (the previous one stays the newest).
        """
        save = self._mine()
        store = self.open()
        assert save.step is not None, "write_data ran first"
        try:
            metadata.version = _DCP_VERSION
            metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
            metadata.storage_meta = StorageMeta(checkpoint_id=str(save.step), save_id=save.save_id)
            doc, pickled = md.encode(metadata, pickle_planner_data=self.pickle_planner_data)
            extra = {md.METADATA_NAME: _uint8(doc)}
            if pickled is not None:
                extra[md.PLANNER_NAME] = _uint8(pickled)
            own = sum(1 for wr in results[save.rank] if isinstance(wr.storage_data, md.ItemLocation)) \
                if save.rank < len(results) else 0
            meta = self._shard_meta(store, save, own)
            meta[md.META_KEY]["metadata"] = md.METADATA_NAME
            step = save.step
            self.last_commit = self._call(save, lambda: self._commit(store, step, extra, meta))
        except BaseException:
            self._abandon(save)
            raise
        self._finished(save)

    # -- helpers -------------------------------------------------------------

    def _mine(self) -> _Save:
        """The save DCP runs on this thread (DCP calls every method of one save from one thread)."""
        save = self._open_session().saves.get(threading.get_ident())
        if save is None or save.done or save.superseded:
            raise DCPStorageError("this save is not in progress any more: a newer save began before it finished "
                                  "(one save at a time per writer: wait for an async_save's future before the next "
                                  "save), or set_up_storage_writer was not called")
        return save

    def _call(self, save: _Save, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the loop thread unless ``save`` was superseded (checked there, beside every store call)."""
        async def guarded() -> T:
            if save.superseded:
                raise DCPStorageError("a newer save began before this one finished: one save at a time per "
                                      "writer (wait for an async_save's future before the next save)")
            return await fn()
        return self._run(guarded())  # type: ignore[no-any-return]

    def _finished(self, save: _Save) -> None:
        save.done = True
        self.last_step = save.step
        session = self._session
        if session is not None and save.step is not None:
            session.last_step = max(save.step, session.last_step or 0)

    def _abandon(self, save: _Save) -> None:
        if save.step is None or save.done or self._session is None:
            return
        step, store = save.step, self._session.loop.store
        save.done = True

        async def drop() -> None:
            if step not in {s for steps in store.versions().values() for s in steps}:
                store.abandon(step)
        try:
            self._run(drop())
        except Exception as exc:  # pragma: no cover - the store is closing
            logger.warning("could not drop the uncommitted step %d: %s", step, exc)

    async def _choose_step(self, store: AsymStore | RankStore, save: _Save) -> int:
        session = self._open_session()
        if isinstance(store, RankStore):
            floor = 0 if session.last_chosen is None else session.last_chosen + 1  # never a step a save took
            step = await store.agree_step(max(save.requested or 0, floor))
            if save.requested is not None and step != save.requested:
                raise StepOrderError(f"step {save.requested} is not newer than the newest global version "
                                     f"(the next is {step})")
            return step
        newest = max((s for s in (store.newest_step, session.last_step, session.last_chosen) if s is not None),
                     default=None)
        if save.requested is None:
            return 0 if newest is None else newest + 1
        if newest is not None and save.requested <= newest:
            held = {s for steps in store.versions().values() for s in steps}
            kind = StepCommittedError if save.requested in held else StepOrderError
            raise kind(f"step {save.requested} is not newer than the newest version, step {newest}")
        return save.requested

    def _stage(self, store: AsymStore | RankStore, save: _Save, plan: SavePlan,
               planner: SavePlanner) -> list[WriteResult]:
        assert save.step is not None
        names = item_names(plan.items)
        results: list[WriteResult] = []
        batch: dict[str, torch.Tensor] = {}
        size = 0
        lent: dict[str, torch.Tensor] = {}  # a stager's host slots (asymstore.dcp.lent): adopted, not copied
        for item, name in zip(plan.items, names, strict=True):
            tensor = _as_tensor(item, planner.resolve_data(item))
            nbytes = tensor.numel() * tensor.element_size()
            if is_lent(tensor):
                lent[name] = tensor
            else:
                batch[name] = tensor
                size += nbytes
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                       storage_data=md.ItemLocation(save.rank, name)))
            if size >= BATCH_BYTES:
                self._put(store, save, batch)
                batch, size = {}, 0
        world = store.world_size if isinstance(store, RankStore) else 1
        batch[md.MARKER_NAME] = torch.tensor([save.rank, world], dtype=torch.int64)
        self._put(store, save, batch)
        if lent:
            step = save.step
            assert step is not None
            self._call(save, lambda: store.adopt_many(step, lent))
        return results

    def _put(self, store: AsymStore | RankStore, save: _Save, batch: dict[str, torch.Tensor]) -> None:
        step = save.step
        assert step is not None
        self._call(save, lambda: store.put_many(step, batch))

    def _shard_meta(self, store: AsymStore | RankStore, save: _Save, items: int) -> dict[str, Any]:
        world = store.world_size if isinstance(store, RankStore) else 1
        return {md.META_KEY: {"format": md.FORMAT, "rank": save.rank, "world_size": world, "items": items,
                              "save_id": save.save_id}}

    async def _commit(self, store: AsymStore | RankStore, step: int, extra: Mapping[str, torch.Tensor],
                      meta: dict[str, Any]) -> CommitResult:
        await store.put_many(step, extra)
        if isinstance(store, RankStore):
            return await store.commit(step, meta, global_meta={md.META_KEY: {"format": md.FORMAT}})
        return await store.commit(step, meta)


def item_names(items: list[WriteItem]) -> list[str]:
    """The stored tensor name of each item: its fully qualified name, ``@offsets`` for a piece.

    A name the store refuses (see :func:`asymstore.format.manifest.validate_name`), one under
    ``.dcp/`` or one already taken is replaced by ``.dcp/item-N``; the metadata records every name.
    """
    used = {md.METADATA_NAME, md.PLANNER_NAME, md.MARKER_NAME}
    out = []
    for i, item in enumerate(items):
        name = item.index.fqn
        data = item.tensor_data
        if item.type == WriteItemType.SHARD and data is not None and tuple(data.chunk.sizes) != tuple(data.size):
            name += "@" + "_".join(str(o) for o in data.chunk.offsets)
        try:
            validate_name(name)
        except InvalidNameError:
            name = ""
        if not name or name in used or name.startswith(md.RESERVED_PREFIX):
            name = f"{md.RESERVED_PREFIX}item-{i}"
        used.add(name)
        out.append(name)
    return out


def _uint8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _as_tensor(item: WriteItem, data: object) -> torch.Tensor:
    """What the store holds for one resolved item: the tensor itself, or a value's bytes as uint8."""
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise DCPStorageError(f"{item.index.fqn!r}: the planner resolved a bytes item to {type(data).__name__}")
        return _uint8(bytes(data.getbuffer()))
    if not isinstance(data, torch.Tensor):
        raise DCPStorageError(f"{item.index.fqn!r}: the planner resolved a tensor item to {type(data).__name__}")
    return data
