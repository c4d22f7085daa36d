"""``StorageReader``: ``dcp.load`` from asymstore versions, with DCP's own resharding.

``read_metadata`` chooses the newest (or the requested) version whose manifests and
``.dcp/metadata`` verify, skipping steps this reader found corrupt; ``prepare_global_plan`` checks
that every rank chose the same step; ``read_data`` reads each stored tensor the plan needs from the
fastest copy that verifies and fills the planner's destinations with verified bytes only. A chunk no
copy holds intact marks the step corrupt: one process that asked for no step goes on from the newest
older version of the same layout, otherwise the typed error is kept in ``error`` and the next load
skips the step on every rank.

Guide (DCP's call order, verification and fallback): ``docs/guides/dcp.md``.
"""

from __future__ import annotations

import io
import logging
import os
import uuid
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DCPStorageReader
from torch.futures import Future

from asymstore.dcp import metadata as md
from asymstore.dcp.sources import RootSource, Source, StoreSource, Version
from asymstore.dcp.spec import StoreSpec, own_store, parse_step, renamed_location
from asymstore.dcp.writer import StorageWriter
from asymstore.errors import (
    AsymstoreError,
    CorruptVersionError,
    DCPMetadataError,
    DCPStorageError,
    NoCheckpointError,
    VersionNotFoundError,
    describe,
)
from asymstore.multirank.store import RankStore
from asymstore.runtime.loop import LoopThread, StoreLoop
from asymstore.store import AsymStore

if TYPE_CHECKING:
    from collections.abc import Coroutine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Agreement:
    """What a rank's load plan carries to the coordinator, and back."""

    step: int | None
    bad: tuple[int, ...] = ()
    skip: tuple[int, ...] = ()


class StorageReader(_DCPStorageReader):
    """A ``torch.distributed.checkpoint.StorageReader`` over asymstore versions written by :class:`StorageWriter`.

    ::

        reader = StorageReader("ckpt")            # or a StorageWriter, tiers, an AsymStore, a RankStore
        dcp.load(state_dict, storage_reader=reader)           # the newest version that verifies
        dcp.load(state_dict, storage_reader=reader, checkpoint_id="step-12")   # exactly this step
        reader.step                                            # the step loaded

    Every byte handed to DCP is verified first (see the module docstring for
    the call order, the choice of version and what a corrupt copy does). DCP's
    planner does the resharding: a version saved by N ranks loads on M ranks,
    or in one process. A multi-rank root is read without a ``RankStore``:
    ``root/global`` and each rank's ``root/rank-NNNNN`` (a shared filesystem, or
    copies of it); a ``RankStore`` reads other ranks' shards through its
    ``peer_tiers``.

    Args:
        location: where the versions are (formerly ``source``, still accepted with a
            ``DeprecationWarning``): a :class:`StorageWriter` (its store, shared:
            resume in the process that goes on saving), an
            :class:`~asymstore.AsymStore` or :class:`~asymstore.multirank.RankStore`
            that is not open yet (opened here, on a loop thread of this reader, and
            closed by :meth:`close`), a list of tiers, a directory (a store's, or a
            multi-rank root) or a tier URI. Tiers and locations are opened read-only:
            no lock, so a writer may be saving into them meanwhile.
        step: load this step (None: the newest that verifies); ``checkpoint_id`` overrides it for one load.
        allow_pickle: unpickle a custom planner's data that a writer stored pickled (with
            ``pickle_planner_data=True``), once its checksum verified. Default: refuse such a version.
        **store_kwargs: options of a store built here.

    Raises:
        DCPStorageError: store options beside a store object; another kind of store.
    """

    def __init__(self, location: StorageWriter | StoreSpec | None = None, *, step: int | None = None,
                 allow_pickle: bool = False, **store_kwargs: Any) -> None:
        """Configure; nothing is opened before the first load (or :meth:`steps`)."""
        super().__init__()
        spec: StorageWriter | StoreSpec = renamed_location(location, store_kwargs, "source", "StorageReader")
        if isinstance(spec, (AsymStore, RankStore, StorageWriter)) and store_kwargs:
            raise DCPStorageError(f"store options {sorted(store_kwargs)} go to the store itself, not beside it")
        self._source_spec = spec
        self._store_kwargs = store_kwargs
        self.default_step = step
        self.allow_pickle = allow_pickle
        self._requested: int | None = None
        self._loop: StoreLoop[AsymStore | RankStore] | LoopThread | None = None
        """The store this reader opened on its loop thread, or the bare loop thread a multi-rank root is read on."""
        self._source: Source | None = None
        self._version: Version | None = None
        self._metadata: Metadata | None = None
        self._expected: dict[MetadataIndex, tuple[torch.Size, torch.dtype] | None] = {}
        self._wanted: int | None = None
        self._single = False
        self.bad_steps: set[int] = set()
        """Steps a load through this reader found corrupt (skipped by later loads)."""
        self.fallbacks: list[str] = []
        """What the last load skipped: newer versions and copies that failed verification."""
        self.step: int | None = None
        """The step the last successful load read (None before one)."""
        self.error: AsymstoreError | None = None
        """The typed error the last load raised here, if any: DCP wraps what a storage raises (in an
        ``AssertionError`` for ``read_metadata``, in a ``CheckpointException`` for the rest)."""

    # -- lifecycle ---------------------------------------------------------

    def _open(self) -> Source:
        if self._source is not None:
            return self._source
        spec = self._source_spec
        if isinstance(spec, StorageWriter):
            store: AsymStore | RankStore | str = spec.open()
        else:
            store = own_store(spec, None, self._store_kwargs, read_only=True)
            # a multi-rank root is read without a store, on a loop thread of its own
            self._loop = LoopThread("asymstore-dcp-reader") if isinstance(store, str) \
                else StoreLoop(store, name="asymstore-dcp-reader")
        if isinstance(store, str):
            self._source = RootSource.of_root(store)
        elif isinstance(store, RankStore):
            rs = store
            self._source = RootSource(rs.root, rs.global_steps, rs.read_global,
                                      lambda r: (rs.tiers, False) if r == rs.rank else (rs.peer_tiers(r), True))
        else:
            self._source = StoreSource(store)
        return self._source

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        self._open()
        if self._loop is None:
            assert isinstance(self._source_spec, StorageWriter)
            return self._source_spec.run_on_store(coro)
        return self._loop.run(coro)

    def steps(self) -> list[int]:
        """The steps a load may choose from, newest first (not yet verified; corrupt ones this reader saw left out)."""
        source = self._open()
        return [s for s in self._run(source.steps()) if s not in self.bad_steps]

    def close(self) -> None:
        """Close what this reader opened (a writer's store stays open); idempotent."""
        loop, self._loop = self._loop, None
        version, self._version = self._version, None
        try:
            if version is not None:
                if loop is not None:
                    loop.run(version.close())
                elif isinstance(self._source_spec, StorageWriter):
                    self._source_spec.run_on_store(version.close())
        finally:
            self._source = None
            if isinstance(loop, StoreLoop):
                loop.close()
            elif loop is not None:
                loop.stop()

    def __enter__(self) -> StorageReader:
        """Return the reader."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close the reader."""
        self.close()

    # -- the StorageReader interface ---------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Load exactly the step ``checkpoint_id`` names in the next load (None: the default).

        Raises:
            DCPStorageError: ``checkpoint_id`` names no step.
        """
        self._requested = None if checkpoint_id is None else parse_step(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a step (see :func:`~asymstore.dcp.spec.parse_step`)."""
        return StorageWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Choose the version (see the module docstring) and return its DCP metadata.

        Raises:
            NoCheckpointError: no DCP version verifies (DCP reports it inside an AssertionError).
            VersionNotFoundError: the requested step is not there.
            DCPStorageError: the chosen version's planner data is pickled and ``allow_pickle`` is False.
        """
        self.error = None
        source = self._open()
        wanted = self._requested if self._requested is not None else self.default_step
        if self._version is not None:
            self._run(self._version.close())
            self._version = None
        self.fallbacks = []
        self._wanted, self._single = wanted, False
        try:
            chosen: tuple[Version, Metadata] = self._run(self._choose(source, wanted))
        except AsymstoreError as exc:
            self.error = exc
            raise
        version, metadata = chosen
        self._version, self._metadata = version, metadata
        self._expected = _expected(metadata)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = uuid.uuid4().hex
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Check the call (collectives on, a version chosen).

        Raises:
            DCPStorageError: ``use_collectives=False``, or no version was chosen by ``read_metadata``.
        """
        if not kwargs.get("use_collectives", True):
            raise DCPStorageError("use_collectives=False is not supported by the DCP storage")
        if self._version is None:
            raise DCPStorageError("read_metadata was not called before set_up_storage_reader")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Record the chosen step (and the steps this rank found corrupt) in the plan."""
        step = None if self._version is None else self._version.step
        return replace(plan, storage_data=_Agreement(step, tuple(sorted(self.bad_steps))))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Check that every rank chose the same version; otherwise tell every rank which steps to skip."""
        self._single = len(plans) == 1  # this process is the whole load: a corrupt version may be replaced in it
        chosen = {p.storage_data.step if isinstance(p.storage_data, _Agreement) else None for p in plans}
        if len(chosen) == 1 and None not in chosen:
            return plans
        steps = sorted(s for s in chosen if s is not None)
        skip = tuple(steps[1:]) if steps else ()
        logger.warning("ranks chose different DCP versions %s; every rank skips %s at the next load", steps, skip)
        return [replace(p, storage_data=_Agreement(None, skip=skip)) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read, verify and hand over every item of ``plan`` (see the module docstring).

        Raises:
            CorruptVersionError: a stored tensor has no copy that verifies (the step is marked corrupt).
            DCPMetadataError: the metadata and a shard disagree (the step is marked corrupt).
            DCPStorageError: the ranks chose different versions (load again).
        """
        try:
            return self._read_data(plan, planner)
        except AsymstoreError as exc:
            self.error = exc
            raise

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        agreement = plan.storage_data
        if isinstance(agreement, _Agreement) and agreement.step is None:
            self.bad_steps.update(agreement.skip)
            raise DCPStorageError(f"the ranks chose different versions; steps {list(agreement.skip)} are skipped "
                                  "from now on: load again")
        try:
            while True:
                version, metadata = self._version, self._metadata
                if version is None or metadata is None:
                    raise DCPStorageError("read_metadata was not called before read_data")
                try:
                    self._read_all(plan, planner, version, metadata)
                    break
                except (CorruptVersionError, DCPMetadataError) as exc:
                    self.bad_steps.add(version.step)
                    self._note(version)
                    logger.error("DCP load of step %d failed verification: %s", version.step, describe(exc))
                    if not self._single or self._wanted is not None or not self._fall_back(metadata):
                        raise
        finally:
            if self._version is not None:
                self._note(self._version)
            self._requested = None
        assert self._version is not None
        self.step = self._version.step
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner, version: Version, metadata: Metadata) -> None:
        """Read every item of ``plan`` from ``version`` into the planner's destinations (verified first)."""
        storage = metadata.storage_data
        groups: dict[md.ItemLocation, list[ReadItem]] = {}
        for item in plan.items:
            where = storage.get(item.storage_index)
            if not isinstance(where, md.ItemLocation):
                raise DCPMetadataError(f"step {version.step}: the metadata locates no chunk {item.storage_index}")
            groups.setdefault(where, []).append(item)
        order = self._run(self._stored_order(version, {w.rank for w in groups}))
        for where in sorted(groups, key=lambda w: (w.rank, order.get((w.rank, w.name), 0))):
            tensor = self._run(version.read(where.rank, where.name))
            for item in groups[where]:
                self._hand_over(planner, item, tensor, version.step)

    def _fall_back(self, metadata: Metadata) -> bool:
        """A single-process load: take the newest older version saved with the same layout (True), or none."""
        assert self._source is not None
        try:
            older: tuple[Version, Metadata] = self._run(self._choose(self._source, None))
        except AsymstoreError as exc:
            self.fallbacks.append(f"no older version to fall back to: {describe(exc)}")
            return False
        version, candidate = older
        same = (candidate.state_dict_metadata == metadata.state_dict_metadata
                and set(candidate.storage_data) == set(metadata.storage_data)
                and candidate.planner_data == metadata.planner_data)
        if not same:
            self.fallbacks.append(f"step {version.step} was saved with another layout: no fallback within this load")
            self._run(version.close())
            return False
        if self._version is not None:
            self._run(self._version.close())
        logger.warning("DCP load falls back to step %d (every item is read again from it)", version.step)
        self._version, self._metadata = version, candidate
        return True

    def _note(self, version: Version) -> None:
        self.fallbacks.extend(f for f in version.fallbacks if f not in self.fallbacks)

    @staticmethod
    async def _stored_order(version: Version, ranks: set[int]) -> dict[tuple[int, str], int]:
        """Where each stored tensor of ``ranks`` sits in its shard (read in stored order: one segment at a time)."""
        out: dict[tuple[int, str], int] = {}
        for rank in ranks:
            try:
                manifest = await version.manifest(rank)
            except AsymstoreError:
                continue  # the read itself reports it
            out.update({(rank, name): i for i, name in enumerate(manifest.tensors)})
        return out

    # -- helpers -------------------------------------------------------------

    async def _choose(self, source: Source, wanted: int | None) -> tuple[Version, Metadata]:
        steps = await source.steps()
        if wanted is not None:
            if wanted not in steps:
                raise VersionNotFoundError(f"step {wanted} is not in {source.description} (it holds {sorted(steps)})")
            candidates = [wanted]
        else:
            candidates = [s for s in steps if s not in self.bad_steps]
        reasons = []
        for step in candidates:
            version: Version | None = None
            try:
                version = await source.version(step)
                metadata = await self._metadata_of(version)
            except DCPStorageError:
                if version is not None:
                    await version.close()
                raise
            except (AsymstoreError, OSError) as exc:
                if version is not None:
                    self.fallbacks.extend(version.fallbacks)
                    await version.close()
                if wanted is not None:
                    raise
                line = f"step {step}: {describe(exc)}"
                reasons.append(line)
                self.fallbacks.append(line)
                logger.warning("DCP load skips %s", line)
                continue
            if reasons:
                logger.warning("DCP load of %s uses step %d after skipping %d newer version(s)",
                               source.description, step, len(reasons))
            return version, metadata
        raise NoCheckpointError(f"no DCP version of {source.description} verifies"
                                + (": " + "; ".join(reasons) if reasons else " (it holds none)"))

    async def _metadata_of(self, version: Version) -> Metadata:
        manifest = await version.manifest(0)
        info = manifest.meta.get(md.META_KEY)
        if not isinstance(info, dict) or info.get("metadata") != md.METADATA_NAME:
            raise DCPMetadataError(f"step {version.step} is not a DCP version (its manifest has no DCP metadata)")
        if info.get("world_size") != version.world_size:
            raise DCPMetadataError(f"step {version.step} was saved by {info.get('world_size')!r} ranks, its "
                                   f"version has {version.world_size} shards")
        doc = _bytes(await version.read(0, md.METADATA_NAME))
        pickled = None
        if md.planner_is_pickled(doc):
            if not self.allow_pickle:
                raise DCPStorageError(f"step {version.step}'s planner data is pickled (saved with "
                                      "pickle_planner_data=True): pass allow_pickle=True to StorageReader to "
                                      "unpickle it (its checksum is verified first)")
            pickled = _bytes(await version.read(0, md.PLANNER_NAME))
        return md.decode(doc, world_size=version.world_size, pickled_planner_data=pickled)

    def _hand_over(self, planner: LoadPlanner, item: ReadItem, tensor: torch.Tensor, step: int) -> None:
        expected = self._expected.get(item.storage_index)
        if item.type == LoadItemType.BYTE_IO:
            if expected is not None or tensor.dtype != torch.uint8 or tensor.dim() != 1:
                raise DCPMetadataError(f"step {step}: {item.storage_index.fqn!r} is not stored as bytes")
            planner.load_bytes(item, io.BytesIO(_bytes(tensor)))
            return
        if expected is None or tuple(tensor.shape) != tuple(expected[0]) or tensor.dtype != expected[1]:
            raise DCPMetadataError(f"step {step}: the stored chunk {item.storage_index} is {tensor.dtype} "
                                   f"{list(tensor.shape)}, the metadata says "
                                   f"{'bytes' if expected is None else f'{expected[1]} {list(expected[0])}'}")
        src = tensor
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            src = src.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != src.size():
            raise DCPMetadataError(f"step {step}: {item.storage_index.fqn!r}: the destination is "
                                   f"{list(target.size())}, the region read {list(src.size())}")
        target.copy_(src)
        planner.commit_tensor(item, target)


def _expected(metadata: Metadata) -> dict[MetadataIndex, tuple[torch.Size, torch.dtype] | None]:
    """Per saved chunk, the shape and dtype its stored tensor must have (None: a bytes item)."""
    out: dict[MetadataIndex, tuple[torch.Size, torch.dtype] | None] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            for chunk in entry.chunks:
                out[MetadataIndex(fqn, chunk.offsets)] = (chunk.sizes, entry.properties.dtype)
        else:
            out[MetadataIndex(fqn)] = None
    return out


def _bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a verified uint8 tensor."""
    if tensor.dtype != torch.uint8:
        raise DCPMetadataError(f"expected a uint8 tensor, got {tensor.dtype}")
    return tensor.numpy().tobytes() if tensor.numel() else b""

