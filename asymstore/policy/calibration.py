"""Per-tier write cost calibration, measured at startup or loaded from a cache.

A :class:`ProbeableTier` is calibrated by writing files of two sizes (:data:`PROBE_SMALL`,
:data:`PROBE_LARGE`, :data:`PROBE_REPEAT` times each, interleaved) as segments are written, into
``ROOT/.tmp-calibrate-<id>/`` (removed afterwards; fsck reports a leftover as ``partial``); ``a``
and ``b`` come from the line through the two medians. Results are cached in ``calibration.json``
under ``$ASYMSTORE_CACHE_DIR``, ``$XDG_CACHE_HOME/asymstore`` or ``~/.cache/asymstore``, keyed by
:meth:`~ProbeableTier.calibration_key`, and measured again after :data:`MAX_AGE_S`.

Probe sizes, cache location and how to skip measuring: docs/concepts/batching.md.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import replace
from typing import Any

from asymstore.format.checksum import host_fill_seconds_per_byte
from asymstore.io.files import atomic_write, read_whole
from asymstore.policy.costmodel import assumed_calibration, fit
from asymstore.tiers.protocol import ProbeableTier
from asymstore.values import TierCalibration

logger = logging.getLogger(__name__)

PROBE_SMALL = 64 << 10
PROBE_LARGE = 8 << 20  # large enough to take the same O_DIRECT path as big segments (asymstore.io.files)
PROBE_REPEAT = 3
MAX_AGE_S = 7 * 24 * 3600.0
CACHE_FORMAT = "asymstore.calibration"
CACHE_VERSION = 1
CACHE_ENV = "ASYMSTORE_CACHE_DIR"


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
