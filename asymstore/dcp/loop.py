"""The DCP storage's former loop thread: ``LoopThread`` lives in :mod:`asymstore.runtime.loop` now.

``asymstore.dcp.loop.LoopThread`` works for one release, with a ``DeprecationWarning``; the writer and
the reader keep their store on a :class:`asymstore.runtime.loop.StoreLoop`.
"""

from __future__ import annotations

from asymstore.runtime.lazy import moved_getattr

__getattr__ = moved_getattr(__name__, {"LoopThread": ("asymstore.runtime.loop", "LoopThread")})
