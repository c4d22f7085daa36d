"""Per-tier write cost calibration, measured at startup or loaded from a cache.

A tier's cost of writing one segment of ``n`` bytes is modelled as
``t_write(n) = a + b·n``: ``a`` is the fixed cost of one write (open, fsync,
latency of a request) and ``b`` the cost per byte. Writing ``N`` bytes as
segments of ``B`` bytes then costs (DESIGN §5)::

    T(B) = a·N/B + b·N + c·B

where ``c·B`` is the part no pipelining hides: the first segment must be
filled (checksummed, compressed) before its write starts, and the last
segment's write is exposed. So ``c = b + f``, with ``f`` the host's cost per
byte of filling a segment (measured: a checksum pass; the batcher adds the
compression cost when it compresses). ``T`` is smallest at
``B* = sqrt(a·N/c)`` (see :func:`optimal_segment_bytes`).

**Measuring.** A tier that implements :class:`ProbeableTier` is calibrated by
writing files of two sizes (:data:`PROBE_SMALL`, :data:`PROBE_LARGE`, each
:data:`PROBE_REPEAT` times, interleaved) the way segments are written (one
``writev`` and an ``fsync`` each) into a scratch directory of the tier
(``ROOT/.tmp-calibrate-<id>/``, removed afterwards; a leftover is reported by
fsck as ``partial`` and removed by ``--repair``). With the median times
``t_s`` and ``t_l``: ``b = (t_l - t_s)/(L - S)`` and ``a = t_s - b·S``.

**Caching.** Results are cached in a JSON file, keyed by the tier's
:meth:`~ProbeableTier.calibration_key` (for directory tiers: the kind, the
filesystem's device number and mount point, and whether files are fsynced),
so one measurement serves every root on the same filesystem. The file is
``$ASYMSTORE_CACHE_DIR/calibration.json``, else
``$XDG_CACHE_HOME/asymstore/calibration.json``, else
``~/.cache/asymstore/calibration.json``. Entries older than
:data:`MAX_AGE_S` are measured again; delete the file (or call
``AsymStore.recalibrate()``) after changing hardware.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from asymstore.format.checksum import checksum
from asymstore.format.names import TMP_PREFIX, fsync_dir
from asymstore.io.files import atomic_write, read_whole, write_parts
from asymstore.tiers.protocol import ProbeableTier

logger = logging.getLogger(__name__)

PROBE_SMALL = 64 << 10
PROBE_LARGE = 8 << 20  # large enough to take the same O_DIRECT path as big segments (fileio)
PROBE_REPEAT = 3
MAX_AGE_S = 7 * 24 * 3600.0
CACHE_FORMAT = "asymstore.calibration"
CACHE_VERSION = 1
CACHE_ENV = "ASYMSTORE_CACHE_DIR"
ALIGN = 4096
MIN_SEGMENT_BYTES = 1 << 20

# when nothing can be measured: a plausible local SSD (1 ms per write, 1 GB/s)
ASSUMED_LATENCY_S = 1e-3
ASSUMED_SECONDS_PER_BYTE = 1e-9


@dataclass(frozen=True)
class TierCalibration:
    """The write cost model of one tier: ``t_write(n) = a + b·n``, exposed cost ``c·B``.

    Attributes:
        latency_s: ``a``, seconds of fixed cost per write (open, fsync, request).
        seconds_per_byte: ``b``, seconds per byte written.
        exposed_seconds_per_byte: ``c``, seconds per byte of one segment that
            do not overlap (``b`` plus the host's cost to fill a segment).
        source: ``"measured"``, ``"cached"``, ``"given"`` or ``"assumed"``.
        key: the cache key it was measured for, if any.
        measured_at: UNIX time of the measurement.
    """

    latency_s: float
    seconds_per_byte: float
    exposed_seconds_per_byte: float
    source: str = "given"
    key: str | None = None
    measured_at: float = 0.0

    def __post_init__(self) -> None:
        """Check that every cost is a finite non-negative number."""
        for name in ("latency_s", "seconds_per_byte", "exposed_seconds_per_byte"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def from_throughput(cls, bytes_per_second: float, latency_s: float, *, source: str = "given") -> TierCalibration:
        """Build a calibration from a bandwidth and a per-write latency (e.g. 100 MB/s, 20 ms)."""
        if bytes_per_second <= 0:
            raise ValueError("bytes_per_second must be positive")
        b = 1.0 / bytes_per_second
        return cls(latency_s, b, b + host_fill_seconds_per_byte(), source=source)

    @property
    def bytes_per_second(self) -> float:
        """The bandwidth ``1/b`` (inf for a free tier)."""
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf

    def write_seconds(self, nbytes: int) -> float:
        """``t_write(n) = a + b·n``: the time one write of ``nbytes`` takes."""
        return self.latency_s + self.seconds_per_byte * nbytes

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> TierCalibration:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: the document is not a calibration.
        """
        if not isinstance(doc, dict):
            raise ValueError("calibration must be a JSON object")
        try:
            return cls(
                latency_s=float(doc["latency_s"]),
                seconds_per_byte=float(doc["seconds_per_byte"]),
                exposed_seconds_per_byte=float(doc["exposed_seconds_per_byte"]),
                source=str(doc.get("source", "cached")),
                key=doc.get("key"),
                measured_at=float(doc.get("measured_at", 0.0)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed calibration: {exc!r}") from exc


def assumed_calibration() -> TierCalibration:
    """The fallback for tiers that cannot be probed: 1 ms per write, 1 GB/s."""
    b = ASSUMED_SECONDS_PER_BYTE
    return TierCalibration(ASSUMED_LATENCY_S, b, b + host_fill_seconds_per_byte(), source="assumed")


def fit(small: int, large: int, t_small: float, t_large: float) -> tuple[float, float]:
    """Return ``(a, b)`` of the line through two timed writes (never negative)."""
    b = max((t_large - t_small) / (large - small), 1e-13)
    a = max(t_small - b * small, 1e-7)
    return a, b


def optimal_segment_bytes(latency_s: float, exposed_seconds_per_byte: float, nbytes: int,
                          max_bytes: int) -> int:
    """Return ``B* = sqrt(a·N/c)``, rounded up to 4 KiB and kept within ``[1 MiB, max_bytes]``.

    ``B`` never exceeds what the version needs (``N`` rounded up to 4 KiB):
    a version smaller than ``B*`` is one segment.
    """
    c = max(exposed_seconds_per_byte, 1e-15)
    best = math.sqrt(latency_s * max(nbytes, 1) / c)
    upper = max(min(max_bytes, _align(nbytes)), ALIGN)
    lower = min(MIN_SEGMENT_BYTES, upper)
    return int(min(max(_align(int(best)), lower), upper))


def predicted_seconds(latency_s: float, seconds_per_byte: float, exposed_seconds_per_byte: float,
                      nbytes: int, segment_bytes: int) -> float:
    """``T(B) = a·⌈N/B⌉ + b·N + c·B`` for ``N = nbytes`` and ``B = segment_bytes``."""
    writes = max(1, math.ceil(nbytes / max(segment_bytes, 1)))
    return latency_s * writes + seconds_per_byte * nbytes + exposed_seconds_per_byte * min(segment_bytes, nbytes)


def _align(n: int) -> int:
    return -(-max(n, 1) // ALIGN) * ALIGN


_fill: float | None = None


def host_fill_seconds_per_byte() -> float:
    """Seconds per byte to fill a segment on this host (one checksum pass), measured once per process."""
    global _fill
    if _fill is None:
        data = memoryview(bytearray(os.urandom(1 << 16)) * 64)  # 4 MiB
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            checksum(data)
            times.append(time.perf_counter() - t0)
        _fill = min(times) / len(data)
    return _fill


# -- probing -----------------------------------------------------------------


def probe_directory(root: str, sizes: Sequence[int], *, fsync: bool,
                    write: Callable[[str, Sequence[memoryview]], object] | None = None,
                    scratch: str | None = None) -> list[float]:
    """Time one segment write per size into ``ROOT/.tmp-calibrate-<id>/``, then remove it.

    ``write(path, parts)`` writes one file the way the tier writes segments
    (default: ``write_parts``, i.e. writev + fsync). ``scratch`` names the
    scratch directory (default: a fresh ``.tmp-calibrate-<id>``).
    """
    scratch = os.path.join(root, scratch or f"{TMP_PREFIX}calibrate-{uuid.uuid4().hex[:8]}")
    os.makedirs(scratch)
    data = memoryview(os.urandom(max(sizes, default=0)))
    times: list[float] = []
    try:
        for i, size in enumerate(sizes):
            path = os.path.join(scratch, f"probe-{i}.bin")
            t0 = time.perf_counter()
            if write is None:
                write_parts(path, [data[:size]], fsync=fsync)
            else:
                write(path, [data[:size]])
            times.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if fsync:
            fsync_dir(root)
    return times


def probe_memory(sizes: Sequence[int]) -> list[float]:
    """Time one copy into a fresh bytearray per size (what an in-memory tier's write does)."""
    data = memoryview(os.urandom(max(sizes, default=0)))
    times = []
    for size in sizes:
        t0 = time.perf_counter()
        buf = bytearray(size)
        buf[:] = data[:size]
        times.append(time.perf_counter() - t0)
        del buf
    return times


def filesystem_key(kind: str, path: str, *, fsync: bool) -> str:
    """Return ``"<kind>:dev=<st_dev>:<mount point>:<fsync|nofsync>"`` for the filesystem holding ``path``."""
    path = os.path.abspath(path)
    dev = os.stat(path).st_dev
    mount = path
    while True:
        parent = os.path.dirname(mount)
        if parent == mount or os.stat(parent).st_dev != dev:
            break
        mount = parent
    return f"{kind}:dev={dev}:{mount}:{'fsync' if fsync else 'nofsync'}"


async def measure(tier: ProbeableTier) -> TierCalibration:
    """Probe ``tier`` with writes of two sizes and fit ``a`` and ``b``."""
    sizes = [PROBE_SMALL, PROBE_LARGE] * PROBE_REPEAT
    times = await tier.probe_writes(sizes)
    t_small = statistics.median(times[0::2])
    t_large = statistics.median(times[1::2])
    a, b = fit(PROBE_SMALL, PROBE_LARGE, t_small, t_large)
    return TierCalibration(a, b, b + host_fill_seconds_per_byte(), source="measured",
                           key=tier.calibration_key(), measured_at=time.time())


# -- the cache ---------------------------------------------------------------


def default_cache_path() -> str:
    """The calibration cache file (see the module docstring for the lookup order)."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "asymstore")
    return os.path.join(base, "calibration.json")


class CalibrationCache:
    """Calibrations by key in one small JSON file; unreadable or unwritable files are logged, never fatal."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, max_age_s: float = MAX_AGE_S) -> None:
        """Use the file at ``path`` (default: :func:`default_cache_path`)."""
        self.path = os.fspath(path) if path is not None else default_cache_path()
        self.max_age_s = max_age_s

    def _load(self) -> dict[str, Any]:
        try:
            doc = json.loads(bytes(read_whole(self.path)))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable calibration cache %s: %s", self.path, exc)
            return {}
        if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or doc.get("version") != CACHE_VERSION:
            logger.warning("ignoring calibration cache %s of an unknown format", self.path)
            return {}
        entries = doc.get("entries")
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> TierCalibration | None:
        """Return the fresh calibration cached for ``key``, or None."""
        doc = self._load().get(key)
        if doc is None:
            return None
        try:
            cal = TierCalibration.from_json(doc)
        except ValueError as exc:
            logger.warning("ignoring cached calibration of %s: %s", key, exc)
            return None
        if time.time() - cal.measured_at > self.max_age_s:
            return None
        return replace(cal, source="cached", key=key)

    def put(self, key: str, cal: TierCalibration) -> None:
        """Store ``cal`` under ``key`` (atomically replacing the file)."""
        entries = self._load()
        entries[key] = replace(cal, key=key).to_json()
        doc = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": entries}
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            atomic_write(self.path, json.dumps(doc, indent=1, sort_keys=True).encode(), fsync=False)
        except OSError as exc:
            logger.warning("could not write calibration cache %s: %s", self.path, exc)


async def calibrate(tier: object, cache: CalibrationCache | None, *, refresh: bool = False) -> TierCalibration:
    """Return ``tier``'s calibration: cached when fresh (unless ``refresh``), else measured (and cached).

    Tiers that do not implement :class:`ProbeableTier`, and probes that
    fail, get :func:`assumed_calibration` (logged).
    """
    if not isinstance(tier, ProbeableTier):
        logger.info("%s cannot be probed; assuming %s", getattr(tier, "name", tier), assumed_calibration())
        return assumed_calibration()
    key = tier.calibration_key()
    if key is not None and cache is not None and not refresh:
        hit = cache.get(key)
        if hit is not None:
            return hit
    try:
        cal = await measure(tier)
    except OSError as exc:
        logger.warning("calibrating %s failed (%s); using the assumed calibration",
                       getattr(tier, "name", tier), exc)
        return assumed_calibration()
    logger.info("calibrated %s: a=%.3g s, b=%.3g s/B (%.0f MB/s)", getattr(tier, "name", tier),
                cal.latency_s, cal.seconds_per_byte, cal.bytes_per_second / 1e6)
    if key is not None and cache is not None:
        cache.put(key, cal)
    return cal
