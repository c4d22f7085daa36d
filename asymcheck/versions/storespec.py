"""Where the Checkpointer's versions go: building the store from what the user passed, and restore info."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asymstore import AsymStore, KeepBest, LocalTier, Tier
from asymstore.api import CheckpointStore, TierStatus

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
               keep_best: KeepBest | None = None) -> CheckpointStore:
    """The store for ``spec``: itself, an AsymStore over a list of tiers, or one over a directory.

    ``spec`` itself is any :class:`~asymstore.api.CheckpointStore` (its own retention applies). A
    directory is a :class:`~asymstore.multirank.RankStore` in a job of several ranks, or when it
    already holds a multi-rank checkpoint.

    ``keep_every`` and ``keep_best`` apply in either: a multi-rank store judges its global versions.
    """
    if isinstance(spec, CheckpointStore):  # AsymStore, RankStore
        return spec
    if isinstance(spec, (str, os.PathLike)):
        from asymstore.multirank import RankStore, is_multirank

        several = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1  # DDP, FSDP2: one shard per rank, a global commit
        if several or is_multirank(os.fspath(spec)):  # (or one process resuming a multi-rank job's root)
            rank, world = (None, None) if several else (0, 1)
            return RankStore(spec, rank=rank, world_size=world, keep_last=keep_last, keep_every=keep_every,
                             keep_best=keep_best)
        return AsymStore([LocalTier(spec)], keep_last=keep_last, keep_every=keep_every, keep_best=keep_best)
    return AsymStore(list(spec), keep_last=keep_last, keep_every=keep_every, keep_best=keep_best)


def on_cuda(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` lives on a CUDA device."""
    return any(p.is_cuda for p in model.parameters())


async def versions_of(store: CheckpointStore) -> dict[str, list[int]]:
    """``store.versions()`` (run on the store's loop)."""
    return store.versions()


async def status_of(store: CheckpointStore) -> dict[str, TierStatus]:
    """``store.status()`` (run on the store's loop)."""
    return store.status()
