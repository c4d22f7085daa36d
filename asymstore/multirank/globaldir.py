"""The multi-rank layout on a directory, and the blocking I/O of its global directory.

::

    ROOT/
      rank-00000/                 rank 0's shards: an ordinary LocalTier root (rank_dirname)
      global/
        LATEST                    hint: newest published global step
        v000000000012.json        global manifest of step 12: the commit point of the multi-rank version
        placement-<hex>.json      where every rank's tiers were when a version was committed (fsck reads it)
        .tmp-v000000000013-<id>   a global manifest being written; .quarantine/: moved aside by fsck --repair

A multi-rank version exists only once its global manifest is published. Guide: ``docs/guides/multirank.md``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import uuid

from asymstore.errors import CorruptVersionError, GlobalManifestError
from asymstore.format.checksum import checksum
from asymstore.format.globalmanifest import GlobalManifest
from asymstore.format.names import LATEST, TMP_PREFIX, parse_rank_dirname
from asymstore.format.placement import MAX_PLACEMENT_BYTES, Placement, placement_filename
from asymstore.io.files import atomic_write, check_regular, fsync_dir, read_whole, write_parts
from asymstore.runtime.lazy import moved_getattr

logger = logging.getLogger(__name__)

GLOBAL_DIR = "global"
_GLOBAL_NAME = re.compile(r"^v(\d{12,20})\.json$")
_PLACEMENT_NAME = re.compile(r"^placement-([0-9a-f]{16})\.json$")

__getattr__ = moved_getattr(__name__, {name: ("asymstore.format.names", name)
                                       for name in ("RANK_PREFIX", "rank_dirname")})


def global_filename(step: int) -> str:
    """Return the file name of the global manifest of ``step``."""
    return f"v{step:012d}.json"


def parse_global_filename(name: str) -> int | None:
    """Return the step of a global manifest file name, or None."""
    match = _GLOBAL_NAME.match(name)
    return int(match.group(1)) if match else None


def is_multirank(root: str) -> bool:
    """True when ``root`` holds the multi-rank layout (a ``global/`` directory)."""
    return os.path.isdir(os.path.join(root, GLOBAL_DIR))


def rank_dirs(root: str) -> dict[int, str]:
    """Return rank -> directory for every rank directory under ``root``."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        rank = parse_rank_dirname(name)
        if rank is not None and os.path.isdir(os.path.join(root, name)):
            out[rank] = os.path.join(root, name)
    return dict(sorted(out.items()))


MAX_GLOBAL_BYTES = 64 << 20
"""The largest global manifest read (about 300,000 ranks' entries)."""


def list_global_steps(gdir: str) -> list[int]:
    """Return the steps with a published global manifest, ascending."""
    try:
        names = os.listdir(gdir)
    except FileNotFoundError:
        return []
    return sorted(s for s in (parse_global_filename(n) for n in names) if s is not None)


def read_global(gdir: str, step: int) -> GlobalManifest:
    """Read and parse the global manifest of ``step``.

    The file is checked first (a regular file, not a symlink, FIFO or device,
    of at most :data:`MAX_GLOBAL_BYTES`), so a hostile one costs bounded time
    and memory.

    Raises:
        FileNotFoundError: it is not published.
        GlobalManifestError: it is not such a file, does not parse, or names another step.
    """
    path = os.path.join(gdir, global_filename(step))
    try:
        check_regular(path, max_size=MAX_GLOBAL_BYTES)
    except CorruptVersionError as exc:
        raise GlobalManifestError(str(exc)) from exc
    manifest = GlobalManifest.from_json(read_whole(path))
    if manifest.step != step:
        raise GlobalManifestError(f"{global_filename(step)} says step {manifest.step}")
    return manifest


def publish_global(gdir: str, manifest: GlobalManifest, *, fsync: bool = True) -> None:
    """Publish a global manifest atomically; never replaces a published one.

    The manifest is written to a temporary file and fsynced, then linked to
    its final name (a link fails if the name exists) and the directory is
    fsynced; filesystems without hard links get a rename after a check.

    Raises:
        FileExistsError: the step is already published.
    """
    os.makedirs(gdir, exist_ok=True)
    final = os.path.join(gdir, global_filename(manifest.step))
    tmp = os.path.join(gdir, f"{TMP_PREFIX}{global_filename(manifest.step)}-{uuid.uuid4().hex[:8]}")
    write_parts(tmp, [manifest.to_json()], fsync=fsync)
    try:
        try:
            os.link(tmp, final)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            if os.path.exists(final):
                raise FileExistsError(final) from exc
            os.rename(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if fsync:
        fsync_dir(gdir)


def write_placement(gdir: str, placement: Placement, *, fsync: bool = True) -> str:
    """Write the placement record (named by its digest) unless it is there already; return the digest."""
    data = placement.to_json()
    digest = checksum(data)
    path = os.path.join(gdir, placement_filename(digest))
    if not os.path.exists(path):
        atomic_write(path, data, fsync=fsync)
    return digest


def read_placement(gdir: str, digest: str) -> Placement:
    """Read and verify the placement record ``digest``.

    Raises:
        FileNotFoundError: there is no such record.
        GlobalManifestError: it is not a regular file of bounded size, is damaged, or has another digest.
    """
    path = os.path.join(gdir, placement_filename(digest))
    try:
        check_regular(path, max_size=MAX_PLACEMENT_BYTES)
    except CorruptVersionError as exc:
        raise GlobalManifestError(str(exc)) from exc
    data = read_whole(path)
    if checksum(data) != digest:
        raise GlobalManifestError(f"{placement_filename(digest)} does not match its name")
    return Placement.from_json(data)


def list_placements(gdir: str) -> list[str]:
    """The digests of the placement records in ``gdir``."""
    try:
        names = os.listdir(gdir)
    except FileNotFoundError:
        return []
    return sorted(m.group(1) for m in map(_PLACEMENT_NAME.match, names) if m)


def write_global_latest(gdir: str, step: int, *, fsync: bool = True) -> None:
    """Replace ``global/LATEST`` atomically."""
    atomic_write(os.path.join(gdir, LATEST), f"{step}\n".encode(), fsync=fsync)


def read_global_latest(gdir: str) -> int | None:
    """Return the ``global/LATEST`` hint, or None (also for anything but a small regular file)."""
    path = os.path.join(gdir, LATEST)
    try:
        check_regular(path, max_size=64)
        return int(read_whole(path).decode().strip())
    except (OSError, ValueError, UnicodeDecodeError, CorruptVersionError):
        return None


def delete_global(gdir: str, step: int, *, fsync: bool = True) -> None:
    """Remove the global manifest of ``step`` (the version stops existing)."""
    try:
        os.unlink(os.path.join(gdir, global_filename(step)))
    except FileNotFoundError:
        return
    if fsync:
        fsync_dir(gdir)
