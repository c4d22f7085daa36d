"""Deprecated: ``asymstore.api`` was split into :mod:`asymstore.values` and :mod:`asymstore.protocols`.

Each name still resolves from here for one release, with a ``DeprecationWarning`` naming its new home.
"""

from __future__ import annotations

from asymstore.runtime.lazy import moved_getattr

_VALUES = ("Targets", "Into", "TierCalibration", "FlushStats", "TierStatus", "CommitResult", "Checkpoint")
_PROTOCOLS = ("CheckpointStore", "DropReportingStore", "CollectiveStore", "ReshardingStore")

__getattr__ = moved_getattr(__name__, {**{n: ("asymstore.values", n) for n in _VALUES},
                                       **{n: ("asymstore.protocols", n) for n in _PROTOCOLS}})
