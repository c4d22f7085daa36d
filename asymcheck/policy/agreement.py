"""Preemption that every rank agrees on: one notice, one step, one iteration boundary.

SIGTERM reaches a job's ranks milliseconds apart, and a rank that flushed and exited alone would
leave the others inside a collective. So the first rank to see a notice publishes, with
``compare_set`` on one key of the job's key-value store (never a collective), the step ``T`` every
rank must complete (``c + 1``, or ``c + 2`` once this iteration's gradients began); every rank reads
the key once per iteration on the training thread, at its first hook after ``optimizer.step()``, and
flushes at the boundary after ``T``: after every collective of ``T``, before any of ``T + 1``. A rank
that cannot reach the store flushes its own shard and records that it lost its peers.

Guide (why T is safe, why no watcher thread): ``docs/guides/preemption.md`` (Several ranks).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from asymstore.dist.fabric import Fabric
from asymstore.dist.kv import KV
from asymstore.protocols import CollectiveStore

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
        fabric: this rank's routes to the job's coordination store (the RankStore's): the notice is
            published in the job's store and put into every node store at once; each rank reads its
            node's (:mod:`asymstore.dist.fabric`), so the per-iteration read costs the job's store nothing
            off the coordinator's node.
        key: the key of this store session's notice.
        rank: this rank.
    """

    def __init__(self, fabric: Fabric | KV, key: str, rank: int) -> None:
        """Nothing is read or written before a notice or a boundary."""
        self.fabric = fabric if isinstance(fabric, Fabric) else Fabric(fabric)
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
            raw = bytes(self.fabric.kv.store.compare_set(self.key, "", mine.to_json()))
            self.fabric.fan_out(self.key, raw.decode())  # before this rank's next collective
        except Exception as exc:  # the store's server is gone (DistNetworkError, RuntimeError, ...)
            self._lose(exc)
            return None
        return self._learn(AgreedNotice.from_json(raw))

    def poll(self) -> AgreedNotice | None:
        """At a boundary: the agreed notice if one was published (one ``check``; ``get`` when set)."""
        if self.notice is not None or self.lost is not None:
            return self.notice
        try:
            if not self.fabric.has(self.key):
                return None
            raw = self.fabric.local.store.get(self.key)
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
