"""What fsck says: the verdict on each entry of a root (:class:`VersionReport`) and on the root (:class:`FsckReport`).

``FsckReport.to_json()`` is the documented ``fsck --json`` schema
(:data:`SCHEMA_VERSION`); a multi-rank root's report
(:class:`~asymstore.fsck.multirank.MultiRankFsckReport`) extends it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from asymstore.format.names import LATEST

SCHEMA_VERSION = 1
Progress = Callable[[int], None]
"""Called with the bytes verified as they are."""


@dataclass
class VersionReport:
    """The verdict on one entry of the root."""

    name: str
    status: str
    step: int | None
    nbytes: int = 0
    problems: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)
    kept_by: list[str] = field(default_factory=list)
    """The retention rules that keep this version (``keep_last``, ``keep_every``, ``keep_best``), as its
    manifests record them; empty when no rule beyond the default was recorded."""
    referenced_by: list[int] = field(default_factory=list)
    """The committed versions that read segments of this one (format 4 references); a ``retained`` entry
    is a deleted version's directory kept for them."""

    @property
    def ok(self) -> bool:
        """True for a sound version (committed, superseded, kept for references), quarantined entry, work going on."""
        return (self.status in ("committed", "superseded", "quarantined", "in_progress", "retained")
                and not self.problems)


@dataclass
class FsckReport:
    """The verdict on a whole root; ``to_json()`` gives the documented schema."""

    root: str
    deep: bool
    entries: list[VersionReport]
    latest: int | None
    latest_problem: str | None
    newest_restorable: int | None
    repaired: list[str] = field(default_factory=list)
    writer: str | None = None
    """The live writer holding the root while it was checked (None: nobody)."""
    layout: str | None = None
    """The root's layout as fsck judged it: ``"single"``, ``"multirank"`` or None (a tier that is no root)."""
    layout_record: dict[str, Any] | None = None
    """The root's ``LAYOUT.json`` as parsed (None: none, or not valid: see ``layout_problems``)."""
    layout_problems: list[str] = field(default_factory=list)
    """What is wrong with the root's layout: a damaged record, versions of two layouts that no record
    explains, a single-process ``LATEST`` in a multi-rank root (see :mod:`asymstore.multirank.rootlayout`)."""
    stale_single_latest: bool = False
    """The root's single-process ``LATEST`` is stale (the root is multi-rank): ``repair`` removes it."""

    @property
    def ok(self) -> bool:
        """True when every entry verifies, LATEST is right and the root's layout is unambiguous."""
        return self.latest_problem is None and not self.layout_problems and all(e.ok for e in self.entries)

    @property
    def problems(self) -> list[str]:
        """Every problem, one line each."""
        lines = [f"{e.name}: {e.status}: {p}" for e in self.entries for p in e.problems]
        if self.latest_problem:
            lines.append(f"{LATEST}: {self.latest_problem}")
        lines += [f"layout: {p}" for p in self.layout_problems]
        return lines

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-ready dict (see docs/guides/fsck.md, 'fsck --json')."""
        return {
            "schema": SCHEMA_VERSION,
            "root": self.root,
            "deep": self.deep,
            "ok": self.ok,
            "latest": self.latest,
            "latest_problem": self.latest_problem,
            "newest_restorable": self.newest_restorable,
            "versions": [asdict(e) | {"ok": e.ok} for e in self.entries],
            "problems": self.problems,
            "repaired": self.repaired,
            "writer": self.writer,
            "layout": self.layout,
            "layout_record": self.layout_record,
            "layout_problems": self.layout_problems,
        }
