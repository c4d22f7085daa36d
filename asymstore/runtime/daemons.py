"""Daemon threads for blocking calls that may never return, reused from call to call.

A call into a transport (a gloo send or receive) can block forever when the peer is gone; its
thread must then never keep the interpreter from exiting, so it is a daemon, which rules out
``concurrent.futures.ThreadPoolExecutor`` (its workers are joined at exit). Starting a thread for
every call costs the caller a start-up handshake each time (about 1 ms on a loaded 2-core machine:
a peer restore of 344 MiB made 46 of them on its event loop). :class:`DaemonWorkers` keeps the
threads that finished a call waiting for the next one; a thread stuck in a call simply never
comes back. A forked child starts with none (the parent's threads do not exist there).
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable

Job = Callable[[], None]
"""A call to run; it must not raise (wrap it to catch and report its own exceptions)."""


class DaemonWorkers:
    """Run jobs on daemon threads, reusing idle ones.

    Args:
        name: the threads' name.
        idle_max: most idle threads kept; one finishing beyond that ends.
    """

    def __init__(self, name: str, idle_max: int = 16) -> None:
        """Start none yet."""
        self.name = name
        self.idle_max = idle_max
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Job]] = []  # each idle thread waits on its own queue
        ref = weakref.ref(self)

        def forget() -> None:  # in a forked child: no thread waits on those queues there
            workers = ref()
            if workers is not None:
                workers._lock = threading.Lock()
                workers._idle = []

        os.register_at_fork(after_in_child=forget)

    def submit(self, job: Job) -> None:
        """Run ``job`` on an idle thread, or on a new one when none is idle."""
        with self._lock:
            box = self._idle.pop() if self._idle else None
        if box is None:
            box = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(box,), name=self.name, daemon=True).start()
        box.put(job)

    @property
    def idle(self) -> int:
        """Threads waiting for a job."""
        with self._lock:
            return len(self._idle)

    def _work(self, box: queue.SimpleQueue[Job]) -> None:
        while True:
            job = box.get()
            job()
            del job  # drop the job's references before waiting for the next one
            with self._lock:
                if len(self._idle) >= self.idle_max:
                    return
                self._idle.append(box)
