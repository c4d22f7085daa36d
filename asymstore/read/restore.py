"""What a restore returns; reading and verifying a version lives in :mod:`asymstore.read.verify`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from asymstore.errors import (
    AsymstoreError,
    CorruptVersionError,
    DestinationMismatchError,
    NoCheckpointError,
    TierError,
    VersionNotFoundError,
)
from asymstore.format.manifest import Manifest
from asymstore.read.load import load_version
from asymstore.read.verify import read_manifest

if TYPE_CHECKING:
    from asymstore.read.load import Into
    from asymstore.write.tierwrite import TierState

__all__ = ["Checkpoint", "describe", "load_version", "read_manifest", "restore_newest"]

logger = logging.getLogger(__name__)



@dataclass
class Checkpoint:
    """A restored version.

    Attributes:
        step: the version's step.
        tensors: name -> tensor, bit-exact with dtype and shape as put.
        meta: the user's JSON metadata.
        tier: name of the tier it was read from.
        manifest: the version's parsed manifest.
        fallbacks: one line per newer version or faster tier that was tried
            and failed verification before this one; empty when none failed.
    """

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    tier: str
    manifest: Manifest
    fallbacks: list[str] = field(default_factory=list)

    @property
    def fell_back(self) -> bool:
        """True when a newer or faster copy failed and this one was used instead."""
        return bool(self.fallbacks)


def describe(exc: BaseException) -> str:
    """Return a one-line reason for a failed load."""
    if isinstance(exc, AsymstoreError):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc!r}"


async def restore_newest(states: Sequence[TierState], step: int | None,
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
    holders: dict[int, list[TierState]] = {}
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
