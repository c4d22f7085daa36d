"""An event loop on a thread of its own, and the store that lives on it (:class:`StoreLoop`).

A store binds its asyncio locks and tasks to one loop, while the code that drives it
(a training loop, ``torch.distributed.checkpoint`` calling a storage from its own
executor thread) is synchronous. So the store is opened on a private loop thread and
every call is sent there: :meth:`LoopThread.run` blocks the caller until a coroutine
ends, :meth:`LoopThread.submit` hands back a ``concurrent.futures.Future``. When the
interpreter exits with the loop still running, the thread is stopped before the
interpreter finalizes (:mod:`asymstore.runtime.exiting`), leaving the store as a
killed process would: committed versions are whole, nothing else counts.
(:func:`asymstore.runtime.sync.run_sync` is the one-shot form: a fresh loop for one call.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, Protocol, TypeVar

from asymstore.errors import StoreClosedError
from asymstore.runtime.exiting import EXIT_WAIT_S, at_exit, cancel

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Opens(Protocol):
    """What :class:`StoreLoop` needs of a store: it opens and closes on the loop."""

    async def open(self) -> object:
        """Open the store (on the loop thread)."""
        ...

    async def close(self) -> object:
        """Close the store: wait for its background work, give its resources back."""
        ...


S = TypeVar("S", bound=Opens)


class LoopThread:
    """A private event loop running on a daemon thread.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        """Start the thread."""
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._stopped = False
        self._exited = False
        self._exit_handle: int | None = at_exit(self._at_exit)

    @property
    def running(self) -> bool:
        """False once :meth:`stop` ran or the interpreter began to exit."""
        return not self._stopped

    @property
    def exited(self) -> bool:
        """True once the interpreter began to exit with the loop running (it was stopped then)."""
        return self._exited

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; return its future.

        Raises:
            StoreClosedError: the loop is stopped (closed, or the interpreter is exiting).
        """
        if self._stopped:
            coro.close()
            raise StoreClosedError(f"{self.name}: the loop is stopped (closed, or the process is exiting)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and return its result (its exception is raised here).

        Raises:
            StoreClosedError: the loop is stopped (closed, or the interpreter is exiting).
            RuntimeError: called from the loop thread itself (it would wait for itself forever).
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(f"{self.name}: run() called from its own loop thread")
        return self.submit(coro).result()

    def call(self, fn: Callable[..., object], *args: Any) -> None:
        """Call a plain function on the loop thread (thread-safe)."""
        self._loop.call_soon_threadsafe(fn, *args)

    def stop_after(self, fut: concurrent.futures.Future[Any]) -> None:
        """Stop the loop once ``fut`` is done, without waiting for it here (the thread ends then)."""
        fut.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._loop.stop))

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
        self._exited = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(EXIT_WAIT_S)
        if self._thread.is_alive():
            logger.warning("the loop thread %s did not stop within %.0f s of the interpreter's exit",
                           self.name, EXIT_WAIT_S)


class StoreLoop(Generic[S]):
    """A store on a private event loop thread: opened on construction, closed by :meth:`close`.

    The thread that owns the store calls :meth:`run` (blocking) or :meth:`submit` (a
    ``concurrent.futures.Future``); every store call happens on the loop thread, so the store's
    asyncio locks and tasks never cross loops. If the interpreter exits with the store still open
    (the program ended by an exception), the loop thread is stopped before the interpreter finalizes:
    the store is left as it is, as if the process had been killed.

    Args:
        store: a store that is not open yet (this loop opens and closes it).
        name: the loop thread's name.
    """

    def __init__(self, store: S, *, name: str = "asymstore-store") -> None:
        """Start the loop thread and open the store on it."""
        self.store = store
        self.thread = LoopThread(name)
        """The loop thread the store lives on."""
        self._closed = False
        try:
            self.run(store.open())
        except BaseException:
            self.thread.stop()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; return its future.

        Raises:
            StoreClosedError: the loop is stopped (the store closed, or the interpreter is exiting).
        """
        return self.thread.submit(coro)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result.

        Raises:
            StoreClosedError: the loop is stopped (the store closed, or the interpreter is exiting).
        """
        return self.thread.run(coro)

    def call(self, fn: Callable[..., object], *args: Any) -> None:
        """Call a plain function on the loop thread (thread-safe)."""
        self.thread.call(fn, *args)

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
        if self._closed or self.thread.exited:
            self._closed = True
            return not self.thread.exited
        self._closed = True
        fut = self.submit(self._close_after(after))
        concurrent.futures.wait([fut], timeout)
        if not fut.done():
            logger.warning("the store did not close within %.1f s: it goes on closing in the background", timeout)
            self.thread.stop_after(fut)
            return False
        try:
            fut.result()
        finally:
            self.thread.stop()
        return True

    async def _close_after(self, after: Sequence[concurrent.futures.Future[Any]]) -> None:
        if after:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in after), return_exceptions=True)
        await self.store.close()
