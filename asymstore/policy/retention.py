"""Retention of one tier (pure): which committed versions ``keep_last`` lets go.

A tier keeps its newest ``keep_last`` versions (its own ``keep_last``, else
the store's; None keeps everything). Versions are deleted only after a newer
one is committed, oldest first, manifest first (the tier's ``delete_version``);
so a version directory without a manifest that is older than the oldest kept
one is what an interrupted delete left (:func:`asymstore.format.names.retention_leftover`).
Multi-rank retention (global versions, the shards they need) is
:mod:`asymstore.multirank.retention`.
"""

from __future__ import annotations

from collections.abc import Iterable


def keep_last_of(tier_keep_last: int | None, store_keep_last: int | None) -> int | None:
    """The retention that applies to a tier: its own ``keep_last``, else the store's (None: keep everything)."""
    return tier_keep_last if tier_keep_last is not None else store_keep_last


def beyond_keep_last(versions: Iterable[int], keep_last: int | None) -> list[int]:
    """The versions to delete, oldest first: all but the newest ``keep_last`` (none when ``keep_last`` is None)."""
    if keep_last is None:
        return []
    ordered = sorted(versions)
    return ordered[:-keep_last] if keep_last > 0 else ordered
