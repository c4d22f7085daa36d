"""Where the Checkpointer's versions go: building the store from what the user passed, and restore info."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from asymstore import KeepBest, Tier
from asymstore.format.names import is_uri
from asymstore.multirank.rootlayout import AcrossLayouts, record_single
from asymstore.opener import open_store
from asymstore.protocols import CheckpointStore, CollectiveStore
from asymstore.values import TierStatus

StoreSpec = CheckpointStore | Sequence[Tier] | str | os.PathLike[str]


@dataclass(frozen=True)
class RestoreInfo:
    """Where ``resume()`` found its version.

    Attributes:
        step: the version restored (optimizer steps completed).
        tier: the tier it was read from.
        fallbacks: newer versions or faster copies that failed verification first.
    """

    step: int
    tier: str
    fallbacks: tuple[str, ...]


def make_store(spec: StoreSpec, keep_last: int | None, *, keep_every: int | None = None,
               keep_best: KeepBest | None = None, across_layouts: AcrossLayouts = "resume") -> CheckpointStore:
    """Deprecated (goes in the next release): :func:`asymstore.open_store` with the same arguments as keywords.

    ``spec`` itself is any :class:`~asymstore.protocols.CheckpointStore` (its own retention applies). A
    directory is opened by its recorded layout (:mod:`asymstore.multirank.rootlayout`): a
    :class:`~asymstore.multirank.RankStore` in a job of several ranks (which resumes a single-process
    root's versions too, unless ``across_layouts="start_fresh"``), or in one process when the root is
    multi-rank (a root stays multi-rank once it is); otherwise an AsymStore over a ``LocalTier`` (over a
    ``RemoteTier`` for a URI). A list of tiers becomes an AsymStore over them.

    ``keep_every`` and ``keep_best`` apply in either: a multi-rank store judges its global versions.

    Raises:
        RootLayoutError: (one process) the root's layout record is not valid.
        RootLayoutConflictError: (one process) the root holds both layouts and no record says which is current.
        ValueError: ``across_layouts`` is not one of its modes.
    """
    warnings.warn("asymcheck.versions.storespec.make_store is deprecated and goes in the next release: use "
                  "asymstore.open_store(location, keep_last=..., keep_every=..., keep_best=..., across_layouts=...)",
                  DeprecationWarning, stacklevel=2)
    return open_store(spec, keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                      across_layouts=across_layouts)


def layout_recorder(spec: StoreSpec, store: CheckpointStore) -> Callable[[], None] | None:
    """What records a directory's single-process layout at the store's first commit (None: nothing to record).

    Only a store :func:`asymstore.open_store` built over a directory for one process: a ``RankStore`` records its
    layout itself (its coordinator, at its first global commit); a store the user built is the user's.
    """
    if not isinstance(spec, (str, os.PathLike)) or isinstance(store, CollectiveStore) or is_uri(os.fspath(spec)):
        return None
    root = os.fspath(spec)
    return lambda: record_single(root)


def on_cuda(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` lives on a CUDA device."""
    return any(p.is_cuda for p in model.parameters())


async def versions_of(store: CheckpointStore) -> dict[str, list[int]]:
    """``store.versions()`` (run on the store's loop)."""
    return store.versions()


async def status_of(store: CheckpointStore) -> dict[str, TierStatus]:
    """``store.status()`` (run on the store's loop)."""
    return store.status()
