"""A tier from where the user points (:func:`from_location`), and a rank's shards (:func:`rank_tier`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from asymstore.format.names import is_uri, rank_dirname

if TYPE_CHECKING:
    from asymstore.tiers.local import LocalTier
    from asymstore.tiers.protocol import Tier


def rank_dir(root: str | os.PathLike[str], rank: int) -> str:
    """The directory of ``rank``'s shards under the multi-rank ``root`` (``root/rank-NNNNN``, :func:`rank_dirname`)."""
    return os.path.join(os.fspath(root), rank_dirname(rank))


def from_location(location: str | os.PathLike[str], *, read_only: bool = False) -> Tier:
    """The tier at ``location``: a :class:`~asymstore.tiers.RemoteTier` for a URI, else a :class:`~asymstore.LocalTier`.

    Nothing is opened or touched before the tier's ``open``.

    Args:
        location: a directory, or a tier URI (``file://``, ``s3://``, ``hdfs://``).
        read_only: the tier is only read (a local one then flushes nothing: ``fsync=False``).
    """
    path = os.fspath(location)
    if is_uri(path):
        from asymstore.tiers.remote.tier import RemoteTier

        return RemoteTier(path)
    from asymstore.tiers.local import LocalTier

    return LocalTier(path, fsync=not read_only)


def rank_tier(root: str | os.PathLike[str], rank: int, *, read_only: bool = True,
              fsync: bool | None = None) -> LocalTier:
    """The :class:`~asymstore.LocalTier` of ``rank``'s shards under the multi-rank ``root`` (``root/rank-NNNNN``).

    Args:
        root: the multi-rank root.
        rank: the rank whose shards the tier holds.
        read_only: the tier is only read (the default: another rank's shards, a tool's reading).
        fsync: flush files and directories (default: ``not read_only``).
    """
    from asymstore.tiers.local import LocalTier

    return LocalTier(rank_dir(root, rank), fsync=not read_only if fsync is None else fsync)
