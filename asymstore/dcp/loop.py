"""An event loop on a thread of its own, on which the DCP storage runs its store.

``torch.distributed.checkpoint`` calls the storage synchronously, from the
training thread (``dcp.save``, ``dcp.load``) or from its own executor thread
(``dcp.async_save``); the store is asynchronous and binds its locks and tasks
to one loop. So the writer (and a reader that opens a store of its own) opens
the store on a private loop thread and sends every call there. When the
interpreter exits with the loop still running, the thread is stopped before
the interpreter finalizes (:mod:`asymstore.runtime.exiting`), leaving the store
as a killed process would: committed versions are whole, nothing else counts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from asymstore.errors import StoreClosedError
from asymstore.runtime.exiting import EXIT_WAIT_S, at_exit, cancel

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """A private event loop running on a daemon thread; :meth:`run` blocks the caller until a coroutine ends.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        """Start the thread."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._stopped = False
        self._exit_handle: int | None = at_exit(self._at_exit)

    @property
    def running(self) -> bool:
        """False once :meth:`stop` ran or the interpreter began to exit."""
        return not self._stopped

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and return its result (its exception is raised here).

        Raises:
            StoreClosedError: the loop is stopped (closed, or the interpreter is exiting).
        """
        if self._stopped:
            coro.close()
            raise StoreClosedError("the DCP storage is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def stop(self) -> None:
        """Stop the loop and join the thread (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        cancel(self._exit_handle)
        self._exit_handle = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def _at_exit(self) -> None:
        """The interpreter exits with the loop running: stop the thread (bounded), close nothing."""
        self._stopped = True
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(EXIT_WAIT_S)
        if self._thread.is_alive():
            logger.warning("the DCP storage's loop thread did not stop within %.0f s of the interpreter's exit",
                           EXIT_WAIT_S)
