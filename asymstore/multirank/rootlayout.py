"""A root's layout, recorded in the root: single-process or multi-rank, its world size, and what came before.

::

    ROOT/
      LAYOUT.json      {"format": 1, "layout": "multirank", "world_size": 3,
                        "previous": [{"layout": "single", "world_size": 1, "newest_step": 6, "resumed": true}]}
      v000000000006/   single-process versions          } at most one of the two is the root's current layout
      global/ rank-*/  multi-rank versions (.globaldir) }

Every reader follows one decision, :attr:`RootSurvey.current`: a root is multi-rank once it holds a
published global version. The record is written atomically by the first commit of a layout, read as
untrusted input (at most :data:`MAX_RECORD_BYTES`, strict JSON, known fields only, else
:class:`~asymstore.errors.RootLayoutError`). Guide: ``docs/guides/fsdp2.md`` (the layout boundary).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Literal

from asymstore.errors import (
    CorruptVersionError,
    LayoutTakeoverError,
    RootLayoutConflictError,
    RootLayoutError,
    RootUnreadableError,
)
from asymstore.format.globalmanifest import GlobalManifest, ShardInfo, shard_digest
from asymstore.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from asymstore.format.names import LATEST, LAYOUT_FILE, parse_rank_dirname, parse_version_dirname, version_dirname
from asymstore.format.parse import parse_manifest
from asymstore.io.files import atomic_write, fsync_dir, read_regular
from asymstore.multirank import globaldir

logger = logging.getLogger(__name__)

FORMAT = 1
"""The record's format version."""
MAX_RECORD_BYTES = 64 << 10
"""The largest record read."""
MAX_PREVIOUS = 64
"""The most earlier layouts a record lists."""

RootKind = Literal["single", "multirank"]
"""A root's layout: one process's versions in the root itself, or ``global/`` and ``rank-NNNNN/``."""
AcrossLayouts = Literal["resume", "start_fresh"]
"""What a multi-rank job does with the versions of a single-process root it opens.

``"resume"`` (default): ``restore`` reads the newest one, each rank taking its part as from a version
of another world size (resharding); if none can be read the error says why. ``"start_fresh"``: they
are not read; the job starts from nothing and its versions begin beside them (the record keeps them
listed as superseded).
"""

_KINDS: tuple[RootKind, ...] = ("single", "multirank")
_ACROSS: tuple[AcrossLayouts, ...] = ("resume", "start_fresh")


def check_across(value: object) -> AcrossLayouts:
    """Return ``value`` if it is an :data:`AcrossLayouts` mode.

    Raises:
        ValueError: it is not.
    """
    for mode in _ACROSS:
        if value == mode:
            return mode
    raise ValueError(f"across_layouts must be one of {_ACROSS}, got {value!r}")


@dataclass(frozen=True)
class PreviousLayout:
    """A layout a root held before its current one.

    Attributes:
        layout: the layout.
        world_size: its number of ranks.
        newest_step: its newest version when it was replaced (None: it held none).
        resumed: whether the job that replaced it resumed that version.
    """

    layout: RootKind
    world_size: int
    newest_step: int | None
    resumed: bool

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object."""
        return {"layout": self.layout, "world_size": self.world_size, "newest_step": self.newest_step,
                "resumed": self.resumed}


@dataclass(frozen=True)
class RootLayout:
    """What ``LAYOUT.json`` says (see the module docstring).

    Attributes:
        layout: the root's current layout.
        world_size: the number of ranks of the job that last recorded it (1 for ``"single"``).
        previous: the layouts it replaced, oldest first.
    """

    layout: RootKind
    world_size: int
    previous: tuple[PreviousLayout, ...] = field(default=())

    def to_json(self) -> bytes:
        """Serialize to UTF-8 JSON."""
        doc = {"format": FORMAT, "layout": self.layout, "world_size": self.world_size,
               "previous": [p.to_json() for p in self.previous]}
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()

    def describe(self) -> str:
        """One line: the layout and its world size."""
        return _kind_name(self.layout, self.world_size)

    @classmethod
    def from_json(cls, data: bytes | bytearray) -> RootLayout:
        """Parse and validate a record.

        Raises:
            RootLayoutError: it is not a valid record of a known format.
        """
        try:
            doc = json.loads(bytes(data).decode("utf-8"), parse_constant=_refuse_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise RootLayoutError(f"{LAYOUT_FILE} is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise RootLayoutError(f"{LAYOUT_FILE} must hold a JSON object")
        if doc.get("format") != FORMAT:
            raise RootLayoutError(f"{LAYOUT_FILE} has format {doc.get('format')!r}; this version reads {FORMAT}")
        unknown = set(doc) - {"format", "layout", "world_size", "previous"}
        if unknown:
            raise RootLayoutError(f"{LAYOUT_FILE} has unknown field(s) {sorted(unknown)}")
        layout, world = _kind(doc.get("layout")), _world(doc.get("world_size"))
        if layout == "single" and world != 1:
            raise RootLayoutError(f"{LAYOUT_FILE}: a single-process layout of {world} ranks")
        previous = doc.get("previous", [])
        if not isinstance(previous, list) or len(previous) > MAX_PREVIOUS:
            raise RootLayoutError(f"{LAYOUT_FILE}: previous must be a list of at most {MAX_PREVIOUS} layouts")
        return cls(layout, world, tuple(_previous(p) for p in previous))


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _kind(value: object) -> RootKind:
    for kind in _KINDS:
        if value == kind:
            return kind
    raise RootLayoutError(f"{LAYOUT_FILE}: layout must be one of {_KINDS}, got {value!r}")


def _world(value: object) -> int:
    if type(value) is not int or not 1 <= value <= 1 << 24:
        raise RootLayoutError(f"{LAYOUT_FILE}: world_size must be an integer in [1, 2**24], got {value!r}")
    return value


def _previous(doc: object) -> PreviousLayout:
    if not isinstance(doc, dict) or set(doc) != {"layout", "world_size", "newest_step", "resumed"}:
        raise RootLayoutError(f"{LAYOUT_FILE}: a previous layout must be an object of layout, world_size, "
                              f"newest_step and resumed")
    step = doc["newest_step"]
    if step is not None and (type(step) is not int or step < 0):
        raise RootLayoutError(f"{LAYOUT_FILE}: newest_step must be a step or null, got {step!r}")
    if type(doc["resumed"]) is not bool:
        raise RootLayoutError(f"{LAYOUT_FILE}: resumed must be true or false")
    return PreviousLayout(_kind(doc["layout"]), _world(doc["world_size"]), step, doc["resumed"])


def _kind_name(layout: RootKind, world: int) -> str:
    return "single-process" if layout == "single" else f"multi-rank ({world} rank(s))"


def read_record(root: str) -> RootLayout | None:
    """The record of ``root``, or None when it has none.

    Raises:
        RootLayoutError: the record is not a regular file of bounded size, or not a valid record.
    """
    path = os.path.join(root, LAYOUT_FILE)
    try:
        data = read_regular(path, max_size=MAX_RECORD_BYTES)  # checked and read on one descriptor
    except (FileNotFoundError, NotADirectoryError):
        return None
    except CorruptVersionError as exc:
        raise RootLayoutError(f"{path}: {exc}") from None
    except OSError as exc:
        raise RootLayoutError(f"{path}: cannot be read: {exc}") from None
    try:
        return RootLayout.from_json(data)
    except RootLayoutError as exc:
        raise RootLayoutError(f"{root}: {exc}") from None


def write_record(root: str, record: RootLayout, *, fsync: bool = True) -> None:
    """Replace ``root``'s record atomically (temporary file, fsync, rename, fsync of the root)."""
    os.makedirs(root, exist_ok=True)
    atomic_write(os.path.join(root, LAYOUT_FILE), record.to_json(), fsync=fsync)
    logger.info("%s: layout recorded: %s", root, record.describe())


@dataclass(frozen=True)
class RootSurvey:
    """What a root holds: its record, and the versions of each layout found in it.

    Attributes:
        root: the root (absolute).
        record: its layout record (None: none, a root written before records, or an empty one).
        single_steps: the single-process versions in the root itself (a directory with a manifest), ascending.
        global_steps: the published multi-rank versions (``global/v….json``), ascending.
        multirank_dirs: whether ``global/`` or a rank directory exists.
        latest: whether the root has a single-process ``LATEST`` hint.
    """

    root: str
    record: RootLayout | None
    single_steps: tuple[int, ...]
    global_steps: tuple[int, ...]
    multirank_dirs: bool
    latest: bool

    def found(self) -> str:
        """What the root holds, in words (for errors and fsck)."""
        parts = []
        if self.single_steps:
            parts.append(f"{len(self.single_steps)} single-process version(s), newest step {self.single_steps[-1]}")
        if self.global_steps:
            world = self.global_world()
            parts.append(f"{len(self.global_steps)} multi-rank version(s)"
                         f"{f' of {world} rank(s)' if world else ''}, newest step {self.global_steps[-1]}")
        rec = f"recorded layout: {self.record.describe()}" if self.record else f"no {LAYOUT_FILE}"
        return f"{self.root}: {'; '.join(parts) or 'no version'} ({rec})"

    def global_world(self) -> int | None:
        """The world size of the newest global version that parses (None: none does)."""
        for step in reversed(self.global_steps):
            try:
                return globaldir.read_global(os.path.join(self.root, globaldir.GLOBAL_DIR), step).world_size
            except (CorruptVersionError, OSError):
                continue
        return None

    @property
    def current(self) -> RootKind | None:
        """The layout whose versions are the root's current ones: the one decision every reader follows.

        Multi-rank once a global version is published; else single-process while the root holds
        single-process versions, whatever else is there (a ``global/`` or rank directories, or a record
        saying multi-rank: what a multi-rank job leaves that opened the root and stopped, or died, before
        its first global version); else, for a root without versions, the record's layout, or multi-rank
        when multi-rank directories exist (None: nothing). Never raises: :attr:`layout` also refuses a
        root whose layouts contradict each other.
        """
        if self.global_steps:
            return "multirank"
        if self.single_steps:
            return "single"
        if self.record is not None:
            return self.record.layout
        return "multirank" if self.multirank_dirs else None

    @property
    def layout(self) -> RootKind | None:
        """The root's current layout (:attr:`current`), for a job that opens the root (None: empty).

        Raises:
            RootLayoutConflictError: versions of both layouts and no record saying which is current, or
                a record of a single-process root whose ``global/`` holds published versions.
        """
        if self.record is not None and self.record.layout == "single" and self.global_steps:
            raise RootLayoutConflictError(f"{self.found()}: the record says single-process, yet global/ "
                                          f"holds published multi-rank versions")
        if self.record is None and self.single_steps and self.global_steps:
            raise RootLayoutConflictError(
                f"{self.found()}: a root of both layouts and no record of which one is current; move the "
                f"versions of the layout no longer wanted out of the root (fsck lists them)")
        return self.current

    def superseded_single(self) -> bool:
        """Whether the record says the single-process versions here were replaced by the multi-rank layout."""
        return (self.record is not None and self.record.layout == "multirank"
                and any(p.layout == "single" for p in self.record.previous))

    def adoptable_single(self) -> tuple[int, ...]:
        """The single-process versions a multi-rank job may resume: only while no global version is published."""
        if self.global_steps:
            return ()
        return self.single_steps

    def reads_multirank(self) -> bool:
        """Whether a reader (fsck, export, a DCP reader) reads the root as multi-rank.

        :attr:`current` says so, and ``global/`` or a rank directory is there.
        """
        return self.current == "multirank" and self.multirank_dirs

    def takeover_pending(self) -> bool:
        """Whether a multi-rank job's first global version would take over a single-process root.

        The root holds single-process versions and no global version yet (see :func:`check_takeover`).
        """
        return self.current == "single" and bool(self.single_steps)


def survey(root: str | os.PathLike[str], *, with_record: bool = True) -> RootSurvey:
    """Look at ``root``: its record and the versions of each layout (nothing is written).

    Args:
        root: the root.
        with_record: read the record (False: leave it out, as for a root without one).

    Raises:
        RootLayoutError: its record is not valid.
    """
    path = os.path.abspath(os.fspath(root))
    record = read_record(path) if with_record else None
    single: list[int] = []
    dirs = False
    gdir = os.path.join(path, globaldir.GLOBAL_DIR)
    try:
        try:
            entries = list(os.scandir(path))
        except (FileNotFoundError, NotADirectoryError):
            entries = []
        for entry in entries:
            step = parse_version_dirname(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False) and _regular(
                    os.path.join(entry.path, MANIFEST_NAME)):
                single.append(step)
            elif entry.name == globaldir.GLOBAL_DIR or parse_rank_dirname(entry.name) is not None:
                dirs = dirs or entry.is_dir(follow_symlinks=False)
        steps = globaldir.list_global_steps(gdir) if os.path.isdir(gdir) else []
    except OSError as exc:  # permission denied, an I/O error: nothing can be judged
        raise RootUnreadableError(f"{path}: its entries cannot be listed, so its layout cannot be judged: "
                                  f"{exc}") from None
    return RootSurvey(path, record, tuple(sorted(single)), tuple(steps), dirs,
                      os.path.lexists(os.path.join(path, LATEST)))


def survey_for_reading(root: str | os.PathLike[str]) -> RootSurvey:
    """:func:`survey` for a reader: a damaged record is judged by what the root holds (fsck names it).

    Raises:
        RootUnreadableError: the root's entries cannot be listed.
    """
    try:
        return survey(root)
    except RootUnreadableError:
        raise
    except RootLayoutError:
        return survey(root, with_record=False)


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def record_single(root: str, *, fsync: bool = True) -> None:
    """Record ``root`` as a single-process root unless its record says so already (a store's first commit).

    A record saying multi-rank under which no global version was ever published (a multi-rank job that
    took the root over and stopped before its first global version) is replaced: the single-process
    versions are the current ones (:attr:`RootSurvey.current`), and the layout that job recorded as
    replaced is dropped from ``previous`` again.

    Raises:
        RootLayoutError: the record there is not valid.
        RootLayoutConflictError: the root is multi-rank (global versions are published).
    """
    found = survey(root)
    record = found.record
    if record is not None and record.layout == "single":
        return
    if found.layout == "multirank":
        raise RootLayoutConflictError(f"{found.found()}: a single-process store committed into a multi-rank root")
    previous = record.previous if record is not None else ()
    if previous and previous[-1].layout == "single":
        previous = previous[:-1]
    write_record(found.root, RootLayout("single", 1, previous), fsync=fsync)


def check_takeover(found: RootSurvey, *, resumed_single: int | None, across_layouts: AcrossLayouts) -> None:
    """Refuse a multi-rank job's first global version beside a single-process root's versions left unread.

    A job that takes a single-process root over (:meth:`RootSurvey.takeover_pending`) either resumed
    one of its versions (``resumed_single``) or was told to start beside them
    (``across_layouts="start_fresh"``); anything else would start over beside committed versions.

    Raises:
        LayoutTakeoverError: neither.
    """
    if not found.takeover_pending() or resumed_single is not None or across_layouts == "start_fresh":
        return
    raise takeover_refusal(found.found(), found.single_steps[-1])


def takeover_refusal(found: str, newest: int) -> LayoutTakeoverError:
    """The refusal of :func:`check_takeover`, for a root that holds ``found`` (in words), newest step ``newest``."""
    return LayoutTakeoverError(
        f"{found}: this multi-rank job would publish its first version beside these single-process "
        f"versions without having resumed them; nothing is committed or published. Call restore() "
        f"(Checkpointer.resume()) first to go on from step {newest}, or pass across_layouts='start_fresh' to "
        f"start beside them explicitly")


def record_multirank(root: str, world_size: int, *, resumed_single: int | None,
                     across_layouts: AcrossLayouts = "resume", fsync: bool = True) -> bool:
    """Record ``root`` as multi-rank of ``world_size`` ranks before a global version is published.

    A single-process layout it replaces goes into ``previous`` (with its newest
    version, and whether this job resumed it: ``resumed_single``); one that an
    earlier takeover recorded without publishing anything is recorded anew.

    Returns:
        Whether it replaced a single-process layout (the caller removes the single-process ``LATEST``
        once the global version is published).

    Raises:
        RootLayoutError: the record there is not valid.
        RootLayoutConflictError: the root holds both layouts and no record says which is current.
        LayoutTakeoverError: it would replace single-process versions neither resumed nor left on
            request (:func:`check_takeover`); nothing is written.
    """
    found = survey(root)
    _ = found.layout  # a root of both layouts and no record: RootLayoutConflictError, nothing is written
    check_takeover(found, resumed_single=resumed_single, across_layouts=across_layouts)
    record = found.record
    previous = record.previous if record is not None else ()
    if found.current != "single":
        if record is not None and record.layout == "multirank" and record.world_size == world_size:
            return False
        write_record(found.root, RootLayout("multirank", world_size, previous), fsync=fsync)
        return False
    if record is not None and record.layout == "multirank" and previous and previous[-1].layout == "single":
        previous = previous[:-1]  # recorded by a takeover that never published: this one replaces it
    newest = found.single_steps[-1] if found.single_steps else None
    previous = (*previous, PreviousLayout("single", 1, newest, resumed_single is not None))[-MAX_PREVIOUS:]
    write_record(found.root, RootLayout("multirank", world_size, previous), fsync=fsync)
    return True


def drop_single_latest(root: str, *, fsync: bool = True) -> bool:
    """Remove the single-process ``LATEST`` of a root whose layout is now multi-rank; return whether it was there."""
    path = os.path.join(root, LATEST)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    if fsync:
        fsync_dir(root)
    logger.info("%s: removed the single-process %s hint (the root is multi-rank now: global/%s)", root, LATEST,
                LATEST)
    return True


SINGLE_ROOT_KEY = "single_process_root"
"""Key of the meta of a global manifest that stands for a single-process version of the root (never published)."""


def single_version(root: str, step: int) -> GlobalManifest:
    """The single-process version ``step`` of ``root`` as a global version of one rank (never written anywhere).

    A multi-rank job resumes it the way it resumes a version of another world size: every rank reads the
    pieces it needs straight from ``root`` (:func:`is_single_root`, :mod:`.reshard`).

    Raises:
        CorruptVersionError: its manifest is not a regular file of bounded size, does not parse, or names
            another step.
        FileNotFoundError: it is not there.
    """
    path = os.path.join(root, version_dirname(step), MANIFEST_NAME)
    manifest = parse_manifest(read_regular(path, max_size=MAX_MANIFEST_BYTES))  # checked and read on one fd
    if manifest.step != step:
        raise CorruptVersionError(f"{path} says step {manifest.step}")
    shard = ShardInfo(0, step, shard_digest(manifest), manifest.nbytes, len(manifest.tensors))
    return GlobalManifest(step, 1, (shard,), {SINGLE_ROOT_KEY: True})


def is_single_root(g: GlobalManifest) -> bool:
    """Whether ``g`` stands for a single-process version of the root (:func:`single_version`)."""
    return g.world_size == 1 and g.meta.get(SINGLE_ROOT_KEY) is True
