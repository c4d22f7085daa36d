"""An event loop on its own thread that owns a store (:class:`asymstore.storeapi.CheckpointStore`).

The training thread calls ``run`` (blocking) or ``submit`` (a
``concurrent.futures.Future``); every store call happens on the loop thread,
so the store's asyncio locks and tasks never cross loops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from asymstore.storeapi import CheckpointStore

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StoreLoop:
    """Runs ``store`` on a private event loop thread; opened on construction.

    Args:
        store: a store that is not open yet (this loop opens and closes it).
    """

    def __init__(self, store: CheckpointStore) -> None:
        """Start the loop thread and open the store on it."""
        self.store = store
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="asymcheck-store", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.run(store.open())
        except BaseException:
            self._stop()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; return its future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return self.submit(coro).result()

    def call(self, fn: Any, *args: Any) -> None:
        """Call a plain function on the loop thread (thread-safe)."""
        self._loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        """Close the store (waits for its background flushes), then stop the loop."""
        if self._closed:
            return
        self._closed = True
        try:
            self.run(self.store.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
