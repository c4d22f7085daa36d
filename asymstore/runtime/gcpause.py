"""Pausing the cyclic garbage collector around bulk object creation.

Building a manifest of tens of thousands of tensors creates as many small
objects; each time the young generation fills, the collector scans them (and
everything still young) again, which can double the time of the whole pass.
Those objects hold no reference cycles, so pausing the collector for the pass
is safe; its previous state is restored after.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic GC for the ``with`` block (re-enabled after, if it was enabled)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
