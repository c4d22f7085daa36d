"""One way to open a store: :func:`open_store` from wherever the user points.

``location`` is a directory, a tier URI (``file://``, ``s3://``, ``hdfs://``), a list of tiers
(fastest first) or a store (returned as it is). Rank and world come from one rule
(:func:`asymstore.dist.world.rank_world`). A directory's layout is decided once, here, from what the
root records (:mod:`asymstore.multirank.rootlayout`): several ranks, or a multi-rank root, get this
rank's ``RankStore``; otherwise an ``AsymStore`` over a ``LocalTier`` (a ``RemoteTier`` for a URI).
``read_only=True`` opens a store that takes no lock and writes nothing; it is never a ``RankStore``,
and a multi-rank root is read without a store (:func:`reads_multirank`).

Guide (the table of what each location gets): ``docs/guides/store.md`` (Opening a store).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack

from asymstore.dist.world import rank_world
from asymstore.errors import RootLayoutError
from asymstore.format.names import is_uri
from asymstore.multirank.rootlayout import AcrossLayouts, check_across, survey, survey_for_reading
from asymstore.policy.retention import KeepBest
from asymstore.protocols import CheckpointStore
from asymstore.store import StoreOptions
from asymstore.tiers.location import from_location
from asymstore.tiers.protocol import Tier

if TYPE_CHECKING:
    from asymstore.multirank.store import RankStore
    from asymstore.store import AsymStore

logger = logging.getLogger(__name__)

Location = CheckpointStore | Sequence[Tier] | str | os.PathLike[str]
"""Where the checkpoint lives: a store, a list of tiers (fastest first), a directory or a tier URI."""

Layout = Literal["single", "multirank"]
"""How a directory is opened: one process's versions in the root itself, or a multi-rank root."""


class RankOptions(TypedDict, total=False):
    """Options only a :class:`~asymstore.multirank.RankStore` takes (ignored by a single-process store).

    See :class:`~asymstore.multirank.RankStore` for each.
    """

    peer_tiers: Callable[[int], Sequence[Tier]] | None
    kv: Any
    restore_timeout_s: float
    wait_global: bool
    namespace: str | None
    fsync: bool


class OpenOptions(StoreOptions, RankOptions, total=False):
    """Every option :func:`open_store` passes on: the store's (:class:`~asymstore.store.StoreOptions`), a RankStore's.

    ``retention_floor`` goes to a single-process store only (see :class:`~asymstore.AsymStore`): a RankStore
    keeps its own.
    """

    retention_floor: Callable[[], int | None] | None


_RANK_ONLY = frozenset(RankOptions.__annotations__)


def reads_multirank(location: str | os.PathLike[str]) -> bool:
    """Whether a reader (fsck, export, a DCP reader, ``open_store(read_only=True)``) reads ``location`` as multi-rank.

    A local directory whose current versions are published global ones
    (:meth:`~asymstore.multirank.rootlayout.RootSurvey.reads_multirank`); a damaged layout record
    is judged by what the root holds (fsck names it). A URI is never one.

    Raises:
        RootUnreadableError: the directory's entries cannot be listed.
    """
    path = os.fspath(location)
    return not is_uri(path) and survey_for_reading(path).reads_multirank()


def writer_layout(root: str | os.PathLike[str], world_size: int) -> Layout:
    """How a job of ``world_size`` ranks that writes opens the directory ``root``.

    Several ranks: multi-rank (each rank's coordinator checks the layout in ``restore`` and at its first
    global commit, every rank hears it). One process: the root's recorded layout (a root stays
    multi-rank once it is), single-process for an empty root.

    Raises:
        RootLayoutError: (one process) the root's layout record is not valid.
        RootLayoutConflictError: (one process) the root holds both layouts and no record says which is current.
    """
    if world_size > 1:
        return "multirank"
    return "multirank" if survey(root).layout == "multirank" else "single"


def open_store(location: Location, *, read_only: bool = False, keep_last: int | None = 3,
               keep_every: int | None = None, keep_best: KeepBest | None = None, timeout_s: float | None = None,
               across_layouts: AcrossLayouts = "resume", root: str | os.PathLike[str] | None = None,
               multirank: bool = False, **options: Unpack[OpenOptions]) -> CheckpointStore:
    """The store for ``location``, not opened yet (see the module docstring for which store each location gets).

    Args:
        location: a store (returned as it is: its own options apply, and ``options`` must be empty), a list
            of tiers (fastest first), a directory or a tier URI.
        read_only: a store that only reads: no lock, nothing written, every version kept.
        keep_last: versions kept (global versions under a RankStore); None keeps all.
        keep_every: also keep every version whose step is a multiple of it.
        keep_best: also keep the best versions by a metric (see :class:`~asymstore.KeepBest`).
        timeout_s: (RankStore) how long the coordinator waits for every rank at a commit (None: its default).
        across_layouts: (RankStore) what its ``restore`` does with a single-process root's versions.
        root: the multi-rank root when ``location`` is this rank's tiers (a RankStore then).
        multirank: always a RankStore (a directory, or tiers with ``root``), as DeepSpeed needs whatever
            the world size (default: decided by the rule above; a root's recorded layout is never overridden).
        **options: the store's options (:class:`~asymstore.store.StoreOptions`) and a RankStore's
            (:class:`RankOptions`, ignored by a single-process store).

    Raises:
        RootLayoutError: (one process, writing) the root's layout record is not valid; (reading) the
            directory is a multi-rank root, which is read without a store.
        RootLayoutConflictError: (one process, writing) the root holds both layouts and no record says
            which is current.
        InvalidValueError: options beside a store object, or a RankStore asked for where none can be
            built (read-only, a URI, tiers without ``root``) or given a ``retention_floor`` (it keeps its own).
        ValueError: ``across_layouts`` is not one of its modes, or a retention rule out of range.
    """
    across_layouts = check_across(across_layouts)
    if isinstance(location, CheckpointStore):  # AsymStore, RankStore, a user's own
        if options:
            _refuse(f"store options {sorted(options)} go to the store itself, not beside it")
        return location
    if read_only and multirank:
        _refuse("a RankStore is never read-only: read a multi-rank root with asymstore.dcp.StorageReader or "
                "python -m asymstore.export")
    _, world = rank_world()
    if isinstance(location, (str, os.PathLike)):
        path = os.fspath(location)
        if is_uri(path):
            if multirank:
                _refuse(f"{path}: a RankStore's root is a directory, not a URI")
            return _single([from_location(path, read_only=read_only)], read_only, keep_last, keep_every,
                           keep_best, options)
        if read_only:
            if reads_multirank(path):
                raise RootLayoutError(f"{path} is a multi-rank root: it is read without a store (asymstore.dcp."
                                      "StorageReader, python -m asymstore.export LOCATION, or a RankStore on "
                                      "every rank of a job)")
            return _single([from_location(path, read_only=True)], True, keep_last, keep_every, keep_best, options)
        layout = "multirank" if multirank else writer_layout(path, world)
        if layout == "multirank":
            return _rank_store(path, None, world, keep_last, keep_every, keep_best, timeout_s, across_layouts,
                               options)
        return _single([from_location(path)], False, keep_last, keep_every, keep_best, options)
    tiers = list(location)
    if multirank and root is None:
        _refuse("a RankStore over a list of tiers needs root= (the directory of the global manifests)")
    if root is not None and not read_only and (multirank or world > 1):
        return _rank_store(os.fspath(root), tiers, world, keep_last, keep_every, keep_best, timeout_s,
                           across_layouts, options)
    return _single(tiers, read_only, keep_last, keep_every, keep_best, options)


def _refuse(message: str) -> None:
    from asymstore.errors import InvalidValueError

    raise InvalidValueError(message)


def _single(tiers: list[Tier], read_only: bool, keep_last: int | None, keep_every: int | None,
            keep_best: KeepBest | None, options: OpenOptions) -> AsymStore:
    """An AsymStore over ``tiers`` (a reader's: read-only, keeping everything, no calibration file)."""
    from asymstore.store import AsymStore

    store_options: dict[str, Any] = {k: v for k, v in options.items() if k not in _RANK_ONLY}
    if read_only:
        store_options.update(read_only=True, calibration_cache=False)
        keep_last, keep_every, keep_best = None, None, None
    return AsymStore(tiers, keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, **store_options)


def _rank_store(root: str, tiers: list[Tier] | None, world: int, keep_last: int | None, keep_every: int | None,
                keep_best: KeepBest | None, timeout_s: float | None, across_layouts: AcrossLayouts,
                options: OpenOptions) -> RankStore:
    """This rank's RankStore of ``root``: by the rank/world rule, or rank 0 of 1 (one process on a multi-rank root)."""
    from asymstore.multirank.store import RankStore

    if options.get("retention_floor") is not None:
        _refuse("a RankStore keeps its own retention floor (its global versions decide): leave retention_floor out")
    rest: dict[str, Any] = {k: v for k, v in options.items() if k != "retention_floor"}
    if timeout_s is not None:
        rest["timeout_s"] = timeout_s
    rank, world_size = rank_world() if world > 1 else (0, 1)
    return RankStore(root, rank=rank, world_size=world_size, tiers=tiers, keep_last=keep_last,
                     keep_every=keep_every, keep_best=keep_best, across_layouts=across_layouts, **rest)


__all__ = ["Layout", "Location", "OpenOptions", "RankOptions", "StoreOptions", "open_store", "reads_multirank",
           "writer_layout"]
