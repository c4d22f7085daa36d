"""The Checkpointer's former loop class: use :class:`asymstore.runtime.loop.StoreLoop` (``name=`` names the thread).

``asymcheck.versions.storeloop.StoreLoop`` works for one release, with a ``DeprecationWarning``: it is
:class:`asymstore.runtime.loop.StoreLoop` whose thread is named ``asymcheck-store``.
"""

from __future__ import annotations

import warnings
from typing import Any

from asymstore.protocols import CheckpointStore
from asymstore.runtime import loop as _loop


class _CheckpointerLoop(_loop.StoreLoop[CheckpointStore]):
    """A :class:`~asymstore.protocols.CheckpointStore` on its loop thread (``asymcheck-store``); opened on construction.

    Args:
        store: a store that is not open yet (this loop opens and closes it).
    """

    def __init__(self, store: CheckpointStore) -> None:
        """Start the loop thread and open the store on it."""
        super().__init__(store, name="asymcheck-store")


def __getattr__(name: str) -> Any:
    """``StoreLoop``, with a DeprecationWarning; removed next release."""
    if name != "StoreLoop":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.StoreLoop is deprecated and goes in the next release: use "
                  "asymstore.runtime.loop.StoreLoop(store, name='asymcheck-store')", DeprecationWarning, stacklevel=2)
    return _CheckpointerLoop
