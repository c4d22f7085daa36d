"""The restore of a store: the newest version that verifies, from the fastest tier that holds it.

Reading and verifying one version on one tier lives in :mod:`asymstore.read.load`
and :mod:`asymstore.read.verify`; what a restore returns is
:class:`asymstore.values.Checkpoint`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from asymstore.errors import (
    AsymstoreError,
    CorruptVersionError,
    DestinationMismatchError,
    NoCheckpointError,
    TierError,
    VersionNotFoundError,
    describe,
)
from asymstore.read.load import load_version
from asymstore.values import Checkpoint

if TYPE_CHECKING:
    from asymstore.tiers.protocol import Tier
    from asymstore.values import Into

logger = logging.getLogger(__name__)


class TierCopies(Protocol):
    """What a restore needs to know of one tier: the tier, its versions, and the copies that failed there.

    The store's per-tier record (``asymstore.write.tierwrite.TierState``) is one.
    """

    tier: Tier
    versions: set[int]
    bad: set[int]


async def restore_newest(states: Sequence[TierCopies], step: int | None,
                         into: Into | None = None) -> Checkpoint:
    """Return the newest version that verifies (or ``step``) from the fastest tier holding it.

    ``states`` are the store's tiers fastest first, with their versions
    listed. A copy that fails verification is skipped, logged, listed in
    ``fallbacks`` and marked bad on its tier; the next tier's copy is tried,
    then the previous version. With ``step`` given, only that step is tried.
    ``into`` names tensors to fill in place (see :mod:`asymstore.read.load`).

    Raises:
        DestinationMismatchError: a tensor of ``into`` does not match the version (never a fallback).
        NoCheckpointError: no tier holds any version.
        VersionNotFoundError: ``step`` is on no tier.
        CorruptVersionError: no copy of any candidate verifies.
    """
    holders: dict[int, list[TierCopies]] = {}
    for state in states:
        for v in state.versions:
            holders.setdefault(v, []).append(state)
    if step is not None:
        if step not in holders:
            raise VersionNotFoundError(f"step {step} is not committed on any tier")
        candidates = [step]
    else:
        if not holders:
            raise NoCheckpointError("no tier holds a committed version")
        candidates = sorted(holders, reverse=True)
    fallbacks: list[str] = []
    for s in candidates:
        for state in holders[s]:
            try:
                manifest, tensors = await load_version(state.tier, s, into)
            except DestinationMismatchError:
                raise  # the caller's tensors do not fit: an older version would not either
            except (AsymstoreError, OSError) as exc:
                reason = f"step {s} on {state.tier.name}: {describe(exc)}"
                logger.warning("restore skipped %s", reason)
                fallbacks.append(reason)
                if isinstance(exc, (CorruptVersionError, TierError, OSError)):
                    state.bad.add(s)
                continue
            state.bad.discard(s)
            if fallbacks:
                logger.warning("restored step %d from %s after %d failed attempt(s)",
                               s, state.tier.name, len(fallbacks))
            return Checkpoint(s, tensors, manifest.meta, state.tier.name, manifest, fallbacks)
    raise CorruptVersionError("no copy verified: " + "; ".join(fallbacks))
