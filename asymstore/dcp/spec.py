"""What the DCP storage accepts: a store, tiers or a location; and ``checkpoint_id`` as a step."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

from asymstore.dist.world import rank_world
from asymstore.errors import DCPStorageError
from asymstore.format.names import is_uri
from asymstore.multirank.store import RankStore
from asymstore.opener import open_store, reads_multirank
from asymstore.protocols import CheckpointStore
from asymstore.runtime.lazy import moved_getattr
from asymstore.store import AsymStore
from asymstore.tiers.protocol import Tier

StoreSpec = CheckpointStore | Sequence[Tier] | str | os.PathLike[str]
"""An :class:`~asymstore.AsymStore`, a :class:`~asymstore.multirank.RankStore`, a list of tiers
(fastest first), a directory, or a tier URI (``file://``, ``s3://``, ``hdfs://``)."""

__getattr__ = moved_getattr(__name__, {"dist_world": ("asymstore.dist.world", "rank_world")})

_STEP = re.compile(r"^(?:(?:.*[-_.])?(?:step|checkpoint|ckpt)[-_]?)?(\d{1,18})$", re.IGNORECASE)
"""The last path component of a ``checkpoint_id``: digits, after ``step``, ``checkpoint`` or ``ckpt`` when any."""


def parse_step(checkpoint_id: object) -> int:
    """The step a DCP ``checkpoint_id`` names: an int, or a string whose last path component names it.

    That component is the step's digits, alone or after ``step``, ``checkpoint`` or ``ckpt`` (and a
    ``-`` or ``_``), which may follow a prefix ending in ``-``, ``_`` or ``.``: ``"12"``,
    ``"step-12"``, ``".../step_12"``, ``"checkpoint_step12"`` (PyTorch's DCP recipe names its saves
    ``f"{CHECKPOINT_DIR}_step{step}"``), ``"checkpoint-12"``, ``"global_step12"``. Nothing else is
    guessed: ``"epoch_3"`` or ``"run-3"`` names no step.

    Raises:
        DCPStorageError: it names no step.
    """
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        if checkpoint_id >= 0:
            return checkpoint_id
    elif isinstance(checkpoint_id, (str, os.PathLike)):
        text = str(os.fspath(checkpoint_id)).rstrip("/\\")
        match = _STEP.match(re.split(r"[/\\]", text)[-1])
        if match:
            return int(match.group(1))
    raise DCPStorageError(f"checkpoint_id {checkpoint_id!r} names no step: give the step as an int or as a "
                          "string such as '12', 'step-12' or 'checkpoint_step12'")


def renamed_location(location: object, store_kwargs: dict[str, Any], old: str, caller: str) -> Any:
    """``location``, or the value under its former keyword ``old`` (deprecated: it warns), out of ``store_kwargs``.

    Raises:
        TypeError: both are given, or neither.
    """
    if old in store_kwargs:
        if location is not None:
            raise TypeError(f"{caller}() got both location= and its former name {old}=")
        warnings.warn(f"{caller}({old}=...) is deprecated and goes in the next release: pass location=...",
                      DeprecationWarning, stacklevel=3)
        return store_kwargs.pop(old)
    if location is None:
        raise TypeError(f"{caller}() missing the argument 'location' (where the checkpoint lives)")
    return location


def own_store(location: StoreSpec, keep_last: int | None, store_kwargs: dict[str, Any], *,
              read_only: bool) -> AsymStore | RankStore | str:
    """The store a writer (or a reader, ``read_only``) builds for ``location``, or the root of a multi-rank checkpoint.

    A store is returned as it is. A reader returns the root of a multi-rank checkpoint (one whose current
    versions are global ones, :func:`asymstore.opener.reads_multirank`) as the string itself: it reads the
    root without any store. Everything else is :func:`asymstore.opener.open_store`'s: a writer of one
    process follows the root's recorded layout as a Checkpointer does, several ranks get a RankStore.

    Raises:
        RootLayoutError: (a writer of one process) the root's layout record is not valid, or the root holds
            both layouts and no record says which is current (RootLayoutConflictError).
        DCPStorageError: options for a store given beside a store object; several ranks and a list of
            tiers or a URI (each rank needs a store of its own: a RankStore); another kind of store.
    """
    if isinstance(location, (AsymStore, RankStore)):
        if store_kwargs:
            raise DCPStorageError(f"store options {sorted(store_kwargs)} go to the store itself, not beside it")
        return location
    if isinstance(location, CheckpointStore):
        raise DCPStorageError(f"the DCP storage works on an AsymStore or a RankStore, not {type(location).__name__}")
    _, world = rank_world()
    many = world > 1 and not read_only
    if isinstance(location, (str, os.PathLike)):
        path = os.fspath(location)
        if is_uri(path) and many:
            raise DCPStorageError(f"{world} ranks cannot share the store at {path}: pass a RankStore "
                                  "with each rank's tiers")
        if read_only and reads_multirank(path):  # published global versions
            return path
    elif many:
        raise DCPStorageError(f"{world} ranks cannot share one list of tiers: pass a RankStore(root, tiers=...) "
                              "on each rank, or a directory")
    store = open_store(location, read_only=read_only, keep_last=keep_last, **store_kwargs)
    assert isinstance(store, (AsymStore, RankStore))
    return store
