"""Errors of the multi-rank layer; each derives from :class:`asymstore.AsymstoreError`."""

from __future__ import annotations

from asymstore.errors import AsymstoreError, CorruptVersionError


class GlobalCommitError(AsymstoreError):
    """A rank's shard is committed but the global version was not published.

    The previous global version stays the newest restorable one; the shards of
    this step are reported by fsck as ``partial``.
    """


class GlobalVersionDroppedError(GlobalCommitError):
    """A rank dropped its version of the step (an edit between steps, a skipped version): no global version.

    The coordinator abandons the step as soon as the report arrives, so the
    next step commits on time; not a storage failure.
    """


class GlobalCommitTimeoutError(GlobalCommitError, TimeoutError):
    """Not every rank reported its shard committed before the timeout."""


class CoordinationTimeoutError(AsymstoreError, TimeoutError):
    """A rank waited too long for the coordinator (or the coordinator for the ranks) outside a commit."""


class WorldSizeMismatchError(AsymstoreError, ValueError):
    """The global version was written by another number of ranks and the store does not reshard.

    See ``RankStore.reshard`` (the Checkpointer sets it; DeepSpeed versions are never resharded).
    """


class GlobalManifestError(CorruptVersionError):
    """A global manifest is not valid JSON of a known format version."""
