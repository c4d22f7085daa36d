"""An event loop on its own thread that owns a store (:class:`asymstore.api.CheckpointStore`).

The training thread calls ``run`` (blocking) or ``submit`` (a
``concurrent.futures.Future``); every store call happens on the loop thread,
so the store's asyncio locks and tasks never cross loops. If the interpreter
exits with the store still open (the program ended by an exception), the loop
thread is stopped before the interpreter finalizes (:mod:`asymstore.runtime.exiting`):
the store is left as it is, as if the process had been killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from asymstore.api import CheckpointStore
from asymstore.errors import StoreClosedError
from asymstore.runtime.exiting import EXIT_WAIT_S, at_exit, cancel

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
        self._exited = False
        self._exit_handle: int | None = at_exit(self._at_exit)
        try:
            self.run(store.open())
        except BaseException:
            self._stop()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; return its future.

        Raises:
            StoreClosedError: the interpreter is exiting and the loop was stopped.
        """
        if self._exited:
            coro.close()
            raise StoreClosedError("the process is exiting: the store's loop is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return self.submit(coro).result()

    def call(self, fn: Any, *args: Any) -> None:
        """Call a plain function on the loop thread (thread-safe)."""
        self._loop.call_soon_threadsafe(fn, *args)

    def close(self, timeout: float | None = None,
              after: Sequence[concurrent.futures.Future[Any]] = ()) -> bool:
        """Close the store (waits for its background flushes), then stop the loop.

        Args:
            timeout: seconds to wait at most (None: as long as it takes). When
                they pass, the store goes on closing on its thread and the loop
                stops once it has; nothing of it is waited for.
            after: work on this loop (commits in flight) that must end before the store closes.

        Returns:
            True when the store closed within ``timeout`` (False after the interpreter began exiting).
        """
        if self._closed:
            return not self._exited
        self._closed = True
        fut = self.submit(self._close_after(after))
        concurrent.futures.wait([fut], timeout)
        if not fut.done():
            logger.warning("the store did not close within %.1f s: it goes on closing in the background", timeout)
            fut.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._loop.stop))
            return False
        try:
            fut.result()
        finally:
            self._stop()
        return True

    async def _close_after(self, after: Sequence[concurrent.futures.Future[Any]]) -> None:
        if after:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in after), return_exceptions=True)
        await self.store.close()

    def _at_exit(self) -> None:
        """The interpreter exits with the store open (or closing): stop the loop thread (bounded), close nothing."""
        if not self._thread.is_alive():
            return
        self._closed = self._exited = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(EXIT_WAIT_S)
        if self._thread.is_alive():
            logger.warning("the store's loop thread did not stop within %.0f s of the interpreter's exit", EXIT_WAIT_S)

    def _stop(self) -> None:
        cancel(self._exit_handle)
        self._exit_handle = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
