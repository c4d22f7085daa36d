"""The copy engine: moves byte spans of live tensors into host slots, off the training thread.

CPU sources are copied by one worker thread with ``memmove`` (one core, the
GIL released, no OpenMP team competing with training's). CUDA sources are
copied on a side stream into pinned memory, ordered after the work already
queued on the compute stream; the drain makes the compute stream wait for the
copies instead of blocking the host. ``mode="inline"`` copies CPU spans in
the calling hook instead (for measurement).

A raw copy only runs from memory that is still the tensor's: each job carries
the tensor's version counter, data address and the storage size it needs, as
recorded when the version opened, and is checked right before the ``memmove``
(and the counter again right after). A job that fails a check copies nothing;
its tensor index is reported by :meth:`CopyEngine.take_bad` and the version is
not committed as if it were clean.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asymstore.runtime.exiting import EXIT_WAIT_S, at_exit, cancel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyJob:
    """Copy bytes ``[start, stop)`` of ``src`` into the same bytes of ``dst`` (a flat uint8 region)."""

    src: torch.Tensor
    dst: torch.Tensor
    start: int
    stop: int
    version: int = -1  # src._version when the version opened (-1: not checked)
    ptr: int = 0  # src.data_ptr() then
    need: int = 0  # bytes of its storage the tensor needs (offset + size)
    index: int = -1  # the tensor's index in its version (reported when a check fails)
    counter: torch.Tensor | None = None  # whose ``_version`` in-place edits move (a DTensor's), default src

    @property
    def edits(self) -> int:
        """The current version counter of what ``src`` belongs to."""
        return (self.src if self.counter is None else self.counter)._version


def intact(job: CopyJob) -> bool:
    """Whether ``job.src`` is still the memory, size and contents-version recorded when its version opened."""
    src = job.src
    if type(src) is not torch.Tensor:  # a subclass (DTensor): no raw memory of its own to read
        return False
    if job.version >= 0 and job.edits != job.version:
        return False
    if job.ptr and (src.data_ptr() != job.ptr or src.untyped_storage().nbytes() < job.need):
        return False
    return True


def _copy_cpu(job: CopyJob) -> bool:
    n = job.stop - job.start
    if n <= 0:
        return True
    if not intact(job):
        return False
    src = job.src
    if src.is_contiguous():
        ctypes.memmove(job.dst.data_ptr() + job.start, src.data_ptr() + job.start, n)
    else:  # never split (the planner keeps it whole): copy with its strides
        job.dst.view(src.dtype).view(src.shape).copy_(src)
    return job.version < 0 or job.edits == job.version  # changed while it was read: not clean either


class CopyEngine:
    """Runs copy jobs; ``wait`` is the only call that blocks training.

    ``busy_seconds`` counts the time spent copying CPU sources and
    ``blocked_seconds`` the part of it during which the caller was blocked:
    inside :meth:`wait` (thread mode) or inside :meth:`submit` itself (inline
    mode, where every copy blocks). Their difference is the copy time that
    overlapped training. CUDA copies are queued on a side stream and not
    timed here (``bytes_copied`` counts them).

    Args:
        mode: ``"thread"`` (default) or ``"inline"`` for CPU sources.
    """

    def __init__(self, mode: str = "thread") -> None:
        """Start the worker thread (thread mode)."""
        if mode not in ("thread", "inline"):
            raise ValueError(f"copy mode must be 'thread' or 'inline', got {mode!r}")
        self.mode = mode
        self.busy_seconds = 0.0
        self.blocked_seconds = 0.0
        self.bytes_copied = 0
        self._waiting_since: float | None = None  # perf_counter() when a wait() began blocking
        self._queue: queue.SimpleQueue[list[CopyJob] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._outstanding = 0
        self._error: BaseException | None = None
        self._stream: Any = None
        self._events: list[Any] = []
        self._thread: threading.Thread | None = None
        self._bad: set[int] = set()
        self._cuda_jobs: list[CopyJob] = []
        self._exit_handle: int | None = None
        if mode == "thread":
            self._thread = threading.Thread(target=self._run, name="asymcheck-copy", daemon=True)
            self._thread.start()
            self._exit_handle = at_exit(self._at_exit)

    def submit(self, jobs: Sequence[CopyJob]) -> None:
        """Start copying ``jobs``; returns before they finish (except inline CPU copies)."""
        cpu = [j for j in jobs if j.src.device.type == "cpu"]
        gpu = [j for j in jobs if j.src.device.type != "cpu"]
        if gpu:
            self._submit_cuda(gpu)
        if not cpu:
            return
        if self.mode == "inline":
            started = time.perf_counter()
            for job in cpu:
                if not _copy_cpu(job):
                    self._bad.add(job.index)
            elapsed = time.perf_counter() - started
            self.busy_seconds += elapsed
            self.blocked_seconds += elapsed  # on the caller's thread: nothing overlapped
            self.bytes_copied += sum(j.stop - j.start for j in cpu)
            return
        with self._cond:
            self._outstanding += 1
        self._queue.put(cpu)

    def _submit_cuda(self, jobs: Sequence[CopyJob]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()  # after everything already queued on the compute stream (step t included)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for job in jobs:
                if not intact(job):
                    self._bad.add(job.index)
                    continue
                self._cuda_jobs.append(job)  # its counter is checked again in wait()
                src = job.src
                if src.is_contiguous():
                    flat = src.reshape(-1).view(torch.uint8)
                    job.dst[job.start:job.stop].copy_(flat[job.start:job.stop], non_blocking=True)
                else:
                    job.dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        self._events.append(done)
        self.bytes_copied += sum(j.stop - j.start for j in jobs)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            started = time.perf_counter()
            bad: list[int] = []
            try:
                for job in batch:
                    if not _copy_cpu(job):
                        bad.append(job.index)
            except BaseException as exc:  # reported by wait()
                logger.exception("copy failed")
                self._error = exc
            ended = time.perf_counter()
            with self._cond:
                self._bad.update(bad)
                self.busy_seconds += ended - started
                if self._waiting_since is not None:  # the caller waited for (the end of) this batch
                    self.blocked_seconds += ended - max(started, self._waiting_since)
                self.bytes_copied += sum(j.stop - j.start for j in batch)
                self._outstanding -= 1
                self._cond.notify_all()

    def wait(self) -> Any:
        """Block until CPU copies are done; order the compute stream after CUDA copies.

        Returns:
            A CUDA event marking the end of every CUDA copy so far (the reader
            of the host buffers must synchronize it), or None.
        """
        with self._cond:
            if self._outstanding:
                self._waiting_since = time.perf_counter()
                self._cond.wait_for(lambda: self._outstanding == 0)
                self._waiting_since = None
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
        for job in self._cuda_jobs:  # an edit queued while the side stream copied: not clean
            if job.version >= 0 and job.edits != job.version:
                self._bad.add(job.index)
        self._cuda_jobs.clear()
        if not self._events:
            return None
        last = self._events[-1]
        self._events.clear()
        torch.cuda.current_stream().wait_event(last)  # step t+1 must not overwrite before the copy
        return last

    def take_bad(self) -> set[int]:
        """Indices of tensors whose copy failed a check since the last call (call after :meth:`wait`)."""
        with self._cond:
            bad, self._bad = self._bad, set()
        return bad

    def close(self) -> None:
        """Stop the worker after the queued copies."""
        cancel(self._exit_handle)
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _at_exit(self) -> None:
        """The interpreter exits: stop the worker after the queued copies, waiting a bounded time."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(EXIT_WAIT_S)
