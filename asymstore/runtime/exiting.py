"""The library's threads at interpreter exit: stopped before the interpreter finalizes, never waited for without bound.

Before ``concurrent.futures`` joins its workers at exit, :func:`exiting` turns true (the library's
polling waits, such as :meth:`asymstore.dist.kv.KV.wait`, give up at once) and the callbacks
registered with :func:`at_exit` run: phase 0 stops the library's threads (event loops, the copy
worker, the replica services), phase 1 ends the I/O their helpers may still be blocked in (the peer
tier's gloo waits). Each callback bounds its own waits (:data:`EXIT_WAIT_S`); :func:`at_exit` says
why a thread left running would end the process in SIGABRT.

Guide (what a job sees when a peer dies): ``docs/guides/multirank.md``.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit join is registered before ours, so ours runs first)
import itertools
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 5.0
"""How long an exit callback waits at most for one thread or one blocked wait to end."""

_exiting = threading.Event()
_lock = threading.Lock()
_ids = itertools.count()
_callbacks: dict[int, tuple[int, Callable[[], None]]] = {}


def exiting() -> bool:
    """True once the interpreter has begun to exit (the library's exit callbacks are running or ran)."""
    return _exiting.is_set()


def at_exit(fn: Callable[[], None], *, phase: int = 0) -> int:
    """Call ``fn`` when the interpreter exits, before any thread is joined; return a handle for :func:`cancel`.

    Why before: once a program ends, ``threading._shutdown`` runs the ``threading._register_atexit``
    callbacks, newest first (``concurrent.futures`` registers one that joins every
    ``ThreadPoolExecutor`` worker without a bound, asyncio's default executor included), joins the
    non-daemon threads, then ``atexit`` runs and the interpreter finalizes. A daemon thread that comes
    back from C++ code that released the GIL (a gloo wait, a TCPStore call, most torch ops) after
    finalization began dies in ``pthread_exit``, whose unwinding through pybind11's
    ``gil_scoped_release`` calls ``std::terminate``: SIGABRT. So :func:`exiting` turns true and these
    callbacks run before ``concurrent.futures`` joins its workers.

    ``fn`` (and the object of a bound method) is held until :func:`cancel` or the exit: what owns a
    running thread must outlive it.

    Args:
        fn: the callback (its exceptions are logged).
        phase: 0 (stop threads) runs before 1 (end the I/O they left behind); newest first within a phase.
    """
    with _lock:
        handle = next(_ids)
        _callbacks[handle] = (phase, fn)
    return handle


def cancel(handle: int | None) -> None:
    """Forget a callback registered with :func:`at_exit` (no error if it is gone)."""
    if handle is not None:
        with _lock:
            _callbacks.pop(handle, None)


def _run() -> None:
    _exiting.set()
    with _lock:
        todo = sorted(_callbacks.items(), key=lambda item: (item[1][0], -item[0]))
        _callbacks.clear()
    for _, (_, fn) in todo:
        try:
            fn()
        except Exception:
            logger.exception("asymstore exit callback %r failed", fn)


_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_run)
else:  # pragma: no cover  (CPython has it since 3.9): later than the joins, still before finalization
    atexit.register(_run)
