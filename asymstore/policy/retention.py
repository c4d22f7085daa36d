"""Retention of one tier (pure): which committed versions the rules keep, and why.

Three rules, any of which keeps a version (orbax's preservation policies are the model):
``keep_last`` (the newest N), ``keep_every`` (every multiple of N, permanently) and ``keep_best``
(the best k by a reported metric). The decision is recorded in each version's manifest meta
(:meth:`Retention.stamp`), so a restart keeps the same set and fsck tells which rule keeps a version.
Versions are deleted only after a newer one is committed, oldest first, manifest first
(:func:`asymstore.format.names.retention_leftover`). Multi-rank retention:
:mod:`asymstore.multirank.retention`.

Guide: ``docs/guides/store.md`` (Retention).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from asymstore.errors import InvalidMetaError

META_KEY = "asymstore"
"""The key of the store's own record in a version's meta (``meta["asymstore"]["retention"]``)."""

Mode = Literal["min", "max"]
"""Whether the best versions have the lowest (a loss) or the highest (an accuracy) metric."""


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``k`` best versions by ``metric`` (``mode`` ``"min"``: lowest first).

    Attributes:
        metric: the name under ``meta["metrics"]`` of a version (for example ``"eval_loss"``).
        mode: ``"min"`` or ``"max"``.
        k: how many best versions are kept.
    """

    metric: str
    mode: Mode = "min"
    k: int = 1

    def __post_init__(self) -> None:
        """Check the rule.

        Raises:
            ValueError: an empty metric name, another mode, or ``k`` < 1.
        """
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError("keep_best needs a metric name")
        if self.mode not in ("min", "max"):
            raise ValueError(f"keep_best mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"keep_best k must be an int >= 1, got {self.k!r}")

    def to_json(self) -> dict[str, Any]:
        """Return the rule as strict JSON."""
        return {"metric": self.metric, "mode": self.mode, "k": self.k}


@dataclass(frozen=True)
class Note:
    """What a version's manifest says about its retention (see the module docstring).

    Attributes:
        pinned: ``keep_every`` kept it permanently when it was committed.
        metric: its value of the ``keep_best`` metric, if it reported one.
    """

    pinned: bool = False
    metric: float | None = None


@dataclass(frozen=True)
class Retention:
    """The retention rules of a store (see the module docstring).

    Attributes:
        keep_last: the newest versions kept (None: every version).
        keep_every: keep every version whose step is a multiple of it, permanently (None: no pins).
        keep_best: keep the best versions by a metric (None: no such rule).
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: KeepBest | None = None

    def __post_init__(self) -> None:
        """Check the rules.

        Raises:
            ValueError: ``keep_last`` or ``keep_every`` not an int >= 1 (or None).
        """
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 (or None), got {value!r}")

    @property
    def reads_notes(self) -> bool:
        """Whether deciding needs the versions' notes (pins or a metric), not only their steps."""
        return self.keep_every is not None or self.keep_best is not None

    def note_meta(self, step: int, meta: Mapping[str, Any]) -> dict[str, Any] | None:
        """The record to write into version ``step``'s meta at commit, or None when no rule needs one."""
        if not self.reads_notes:
            return None
        record: dict[str, Any] = {"rules": self.to_json()}
        if self.keep_every is not None and step % self.keep_every == 0:
            record["pinned"] = "keep_every"
        if self.keep_best is not None:
            value = metric_of(meta, self.keep_best.metric)
            if value is not None:
                record["metric"] = {"name": self.keep_best.metric, "value": value}
        return record

    def stamp(self, step: int, meta: Mapping[str, Any], into: dict[str, Any]) -> None:
        """Record the rules' decision on version ``step`` (judged on its ``meta``) in the meta ``into``.

        The record goes under ``into["asymstore"]["retention"]`` (:meth:`note_meta`), so a restart keeps
        the same set. ``into`` is the version's own meta (a single store), or the meta of the global
        manifest judged on the coordinator's shard meta (a multi-rank store), which then also carries
        ``meta["metrics"]`` when ``keep_best`` reads it. Nothing changes when no rule needs a record.

        Raises:
            InvalidMetaError: ``into`` already holds the store's own key (:data:`META_KEY`).
        """
        record = self.note_meta(step, meta)
        if record is None:
            return
        if META_KEY in into:
            raise InvalidMetaError(f"meta key {META_KEY!r} is the store's own record; use another key")
        into[META_KEY] = {"retention": record}
        if self.keep_best is not None and "metrics" in meta:
            into.setdefault("metrics", meta["metrics"])

    def note_of(self, meta: Mapping[str, Any]) -> Note:
        """Read a committed version's note from its meta (untrusted: anything malformed counts as no note)."""
        record = _record(meta)
        pinned = record.get("pinned") == "keep_every"
        value = None
        if self.keep_best is not None:
            value = metric_of(meta, self.keep_best.metric)
        return Note(pinned, value)

    def kept(self, notes: Mapping[int, Note], *, keep_last: int | None = None,
             persistent: bool = True) -> dict[int, list[str]]:
        """The versions the rules keep, each with the rules that keep it.

        Args:
            notes: every committed version of the tier, by step.
            keep_last: the tier's own ``keep_last`` (None: the store's).
            persistent: False for a memory tier: only the newest versions are kept there.
        """
        last = self.keep_last if keep_last is None else keep_last
        reasons: dict[int, list[str]] = {}
        steps = sorted(notes)
        for step in steps if last is None else steps[-last:]:
            reasons.setdefault(step, []).append("keep_last")
        if persistent:
            for step in steps:
                if notes[step].pinned:
                    reasons.setdefault(step, []).append("keep_every")
            best = self.keep_best
            if best is not None:
                scored = [(n.metric, step) for step, n in notes.items() if n.metric is not None]
                scored.sort(key=lambda ms: (ms[0] if best.mode == "min" else -ms[0], -ms[1]))
                for _, step in scored[:best.k]:
                    reasons.setdefault(step, []).append("keep_best")
        return reasons

    def to_delete(self, notes: Mapping[int, Note], *, keep_last: int | None = None,
                  persistent: bool = True) -> list[int]:
        """The versions no rule keeps, oldest first."""
        kept = self.kept(notes, keep_last=keep_last, persistent=persistent)
        return [step for step in sorted(notes) if step not in kept]

    def to_json(self) -> dict[str, Any]:
        """Return the rules as strict JSON."""
        return {"keep_last": self.keep_last, "keep_every": self.keep_every,
                "keep_best": self.keep_best.to_json() if self.keep_best is not None else None}


def metric_of(meta: Mapping[str, Any], name: str) -> float | None:
    """The finite number ``meta["metrics"][name]``, or None."""
    metrics = meta.get("metrics")
    if not isinstance(metrics, Mapping):
        return None
    value = metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def recorded_rules(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The rules in force when the version was committed, as recorded in its meta (None if not recorded)."""
    rules = _record(meta).get("rules")
    return rules if isinstance(rules, dict) else None


def _record(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    own = meta.get(META_KEY)
    record = own.get("retention") if isinstance(own, Mapping) else None
    return record if isinstance(record, Mapping) else {}


def keep_last_of(tier_keep_last: int | None, store_keep_last: int | None) -> int | None:
    """The ``keep_last`` that applies to a tier: its own, else the store's (None: keep everything)."""
    return tier_keep_last if tier_keep_last is not None else store_keep_last


def beyond_keep_last(versions: Iterable[int], keep_last: int | None) -> list[int]:
    """The versions to delete under ``keep_last`` alone, oldest first: all but the newest ``keep_last``."""
    if keep_last is None:
        return []
    ordered = sorted(versions)
    return ordered[:-keep_last] if keep_last > 0 else ordered
