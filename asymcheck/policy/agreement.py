"""Preemption that every rank agrees on: one notice, one step, one iteration boundary.

SIGTERM reaches the ranks of a job milliseconds apart. A rank that flushed and
exited at its own next hook would leave the others inside (or about to enter)
a collective of the training step, where they die with a connection error
instead of the signal. So under several ranks a notice is agreed on through
the job's key-value store (the TCPStore client of the
:class:`asymstore.multirank.RankStore`; never a collective, never from a
background thread):

1. The first rank to see a notice of its own (its SIGTERM at its next hook,
   or ``preempt()``) publishes it with ``compare_set`` on one key: the step
   ``T`` every rank must complete before it stops. A rank that has completed
   ``c`` steps publishes ``T = c + 1`` from the iteration boundary or from a
   forward hook of iteration ``c + 1`` (no rank can have completed step
   ``c + 1``: its gradients need this rank's), and ``T = c + 2`` once this
   iteration's gradients began (their collectives may be done, so another
   rank may already be past step ``c + 1``). The first value wins; a later
   publisher reads and adopts it.
2. Every rank reads the key once per iteration, at its first training hook
   after ``optimizer.step()`` (the *boundary*: one ``check``, a few tens of
   microseconds on a local TCPStore), until it knows ``T``.
3. Every rank trains on to step ``T`` (at most one step past the one in flight)
   and flushes at the boundary after it, before the forward of ``T + 1``: no
   rank can have passed that boundary when ``T`` was published, and every rank
   reads the key at each boundary it passes, so all stop at the same one, after
   every collective of step ``T`` and before any of ``T + 1``.

The boundary read is on the training thread, not a watcher thread: one round
trip per iteration is negligible next to a training step, it is synchronous
with the boundary (a watcher's flag could be set just after a rank passed a
boundary, which the argument of step 3 rules out), and a watcher polling every
few milliseconds on every rank would load the job's single store server far
more than one read per rank per iteration.

A rank that cannot reach the key-value store (its server, hosted by rank 0 or
the launcher, is gone) records that it lost its peers and, if it has a notice
of its own, flushes at once what it can: its own shard.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from asymstore.api import CollectiveStore
from asymstore.dist.kv import KV

logger = logging.getLogger(__name__)

NoticeReason = Literal["SIGTERM", "explicit"]


@dataclass(frozen=True)
class AgreedNotice:
    """A notice every rank acts on.

    Attributes:
        step: the step every rank completes and flushes (``T``).
        rank: the rank that published it.
        reason: ``"SIGTERM"`` (ranks that only read it still exit as if signalled) or ``"explicit"``.
    """

    step: int
    rank: int
    reason: NoticeReason

    def to_json(self) -> str:
        """The key's value."""
        return json.dumps({"step": self.step, "rank": self.rank, "reason": self.reason})

    @classmethod
    def from_json(cls, raw: Any) -> AgreedNotice:
        """Parse the key's value (bytes or str)."""
        msg = json.loads(bytes(raw).decode() if not isinstance(raw, str) else raw)
        reason: NoticeReason = "explicit" if msg["reason"] == "explicit" else "SIGTERM"
        return cls(int(msg["step"]), int(msg["rank"]), reason)


class PreemptAgreement:
    """One rank's side of the agreement (see the module docstring).

    Args:
        kv: the job's coordination store (the RankStore's).
        key: the key of this store session's notice.
        rank: this rank.
    """

    def __init__(self, kv: KV, key: str, rank: int) -> None:
        """Nothing is read or written before a notice or a boundary."""
        self.kv = kv
        self.key = key
        self.rank = rank
        self.notice: AgreedNotice | None = None
        """The agreed notice, once this rank knows it."""
        self.seen: float | None = None
        """When (``time.monotonic()``) this rank learned the agreed notice."""
        self.lost: str | None = None
        """Why the key-value store could not be used (its peers are gone), if it could not."""

    def publish(self, step: int, reason: NoticeReason) -> AgreedNotice | None:
        """Propose ``step`` as the one every rank flushes; return the agreed notice (the first proposed wins).

        Returns:
            The agreed notice, or None when the key-value store is unreachable (``lost`` says why).
        """
        if self.notice is not None or self.lost is not None:
            return self.notice
        mine = AgreedNotice(step, self.rank, reason)
        try:
            raw = self.kv.store.compare_set(self.key, "", mine.to_json())
        except Exception as exc:  # the store's server is gone (DistNetworkError, RuntimeError, ...)
            self._lose(exc)
            return None
        return self._learn(AgreedNotice.from_json(raw))

    def poll(self) -> AgreedNotice | None:
        """At a boundary: the agreed notice if one was published (one ``check``; ``get`` when set)."""
        if self.notice is not None or self.lost is not None:
            return self.notice
        try:
            if not self.kv.store.check([self.key]):
                return None
            raw = self.kv.store.get(self.key)
        except Exception as exc:
            self._lose(exc)
            return None
        return self._learn(AgreedNotice.from_json(raw))

    def _learn(self, notice: AgreedNotice) -> AgreedNotice:
        self.notice = notice
        self.seen = time.monotonic()
        logger.warning("rank %d: preemption notice (%s from rank %d): every rank flushes step %d",
                       self.rank, notice.reason, notice.rank, notice.step)
        return notice

    def _lose(self, exc: Exception) -> None:
        self.lost = f"{type(exc).__name__}: {exc}"
        logger.warning("rank %d: the job's key-value store is unreachable, no preemption agreement: %s",
                       self.rank, self.lost)


def agreement_for(store: object) -> PreemptAgreement | None:
    """The agreement of a collective store of several ranks (opened); None for any other store."""
    if not isinstance(store, CollectiveStore) or store.world_size < 2:
        return None
    return PreemptAgreement(store.coordination(), store.session_key("preempt"), store.rank)
