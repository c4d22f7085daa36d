"""The Checkpointer's store on its own event loop thread: :class:`asymstore.runtime.loop.StoreLoop`.

The loop thread and the store's open and close live in :mod:`asymstore.runtime.loop` (one class
for the Checkpointer and the DCP storage); this module names the Checkpointer's kind of it.
"""

from __future__ import annotations

from asymstore.api import CheckpointStore
from asymstore.runtime import loop as _loop


class StoreLoop(_loop.StoreLoop[CheckpointStore]):
    """A :class:`~asymstore.api.CheckpointStore` on its loop thread (``asymcheck-store``); opened on construction.

    Args:
        store: a store that is not open yet (this loop opens and closes it).
    """

    def __init__(self, store: CheckpointStore) -> None:
        """Start the loop thread and open the store on it."""
        super().__init__(store, name="asymcheck-store")


__all__ = ["StoreLoop"]
