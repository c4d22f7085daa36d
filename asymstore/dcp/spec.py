"""What the DCP storage accepts: a store, tiers or a location; and ``checkpoint_id`` as a step."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from asymstore.api import CheckpointStore
from asymstore.errors import DCPStorageError
from asymstore.format.names import is_uri
from asymstore.multirank.store import RankStore
from asymstore.store import AsymStore
from asymstore.tiers.protocol import Tier

StoreSpec = CheckpointStore | Sequence[Tier] | str | os.PathLike[str]
"""An :class:`~asymstore.AsymStore`, a :class:`~asymstore.multirank.RankStore`, a list of tiers
(fastest first), a directory, or a tier URI (``file://``, ``s3://``, ``hdfs://``)."""

_STEP = re.compile(r"^(?:.*[/\\])?(?:step[-_]?)?(\d{1,18})$")


def parse_step(checkpoint_id: object) -> int:
    """The step a DCP ``checkpoint_id`` names: an int, or a string like ``"12"``, ``"step-12"``, ``".../step_12"``.

    Raises:
        DCPStorageError: it names no step.
    """
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        if checkpoint_id >= 0:
            return checkpoint_id
    elif isinstance(checkpoint_id, (str, os.PathLike)):
        match = _STEP.match(str(os.fspath(checkpoint_id)).rstrip("/\\"))
        if match:
            return int(match.group(1))
    raise DCPStorageError(f"checkpoint_id {checkpoint_id!r} names no step: give the step as an int or as a "
                          "string such as '12' or 'step-12'")


def dist_world() -> tuple[int, int]:
    """This process's rank and the world's size under torch.distributed, or (0, 1) when it is not initialized."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def own_store(spec: StoreSpec, keep_last: int | None, store_kwargs: dict[str, Any], *,
              read_only: bool) -> AsymStore | RankStore | str:
    """The store a writer (or a reader, ``read_only``) builds for ``spec``, or the root of a multi-rank checkpoint.

    A store is returned as it is. A reader returns the root of a multi-rank checkpoint (one whose current
    versions are global ones, :meth:`~asymstore.multirank.rootlayout.RootSurvey.reads_multirank`) as the
    string itself: it reads the root without any store. A writer of one process follows the root's layout
    as a Checkpointer does (:attr:`~asymstore.multirank.rootlayout.RootSurvey.layout`).

    Raises:
        RootLayoutError: (a writer of one process) the root's layout record is not valid, or the root holds
            both layouts and no record says which is current (RootLayoutConflictError).
        DCPStorageError: options for a store given beside a store object; several ranks and a list of
            tiers or a URI (each rank needs a store of its own: a RankStore); another kind of store.
    """
    from asymstore.multirank.rootlayout import survey, survey_for_reading
    from asymstore.tiers.local import LocalTier

    if isinstance(spec, (AsymStore, RankStore)):
        if store_kwargs:
            raise DCPStorageError(f"store options {sorted(store_kwargs)} go to the store itself, not beside it")
        return spec
    if isinstance(spec, CheckpointStore):
        raise DCPStorageError(f"the DCP storage works on an AsymStore or a RankStore, not {type(spec).__name__}")
    _, world = dist_world()
    many = world > 1 and not read_only
    options: dict[str, Any] = {"keep_last": keep_last, **store_kwargs}
    if read_only:
        options.update(read_only=True, keep_last=None, calibration_cache=False)
    if isinstance(spec, (str, os.PathLike)):
        location = os.fspath(spec)
        if is_uri(location):
            if many:
                raise DCPStorageError(f"{world} ranks cannot share the store at {location}: pass a RankStore "
                                      "with each rank's tiers")
            from asymstore.tiers.remote.tier import RemoteTier

            return AsymStore([RemoteTier(location)], **options)
        if read_only and survey_for_reading(location).reads_multirank():  # published global versions
            return location
        if many:
            return RankStore(location, keep_last=keep_last, **store_kwargs)
        if not read_only and survey(location).layout == "multirank":  # one process writing on into a multi-rank root
            return RankStore(location, rank=0, world_size=1, keep_last=keep_last, **store_kwargs)
        return AsymStore([LocalTier(location, fsync=not read_only)], **options)
    tiers = list(spec)
    if many:
        raise DCPStorageError(f"{world} ranks cannot share one list of tiers: pass a RankStore(root, tiers=...) "
                              "on each rank, or a directory")
    return AsymStore(tiers, **options)
