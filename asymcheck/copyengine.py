"""The copy engine: moves byte spans of live tensors into host slots, off the training thread.

CPU sources are copied by one worker thread with ``memmove`` (one core, the
GIL released, no OpenMP team competing with training's). CUDA sources are
copied on a side stream into pinned memory, ordered after the work already
queued on the compute stream; the drain makes the compute stream wait for the
copies instead of blocking the host. ``mode="inline"`` copies CPU spans in
the calling hook instead (for measurement).
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

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyJob:
    """Copy bytes ``[start, stop)`` of ``src`` into the same bytes of ``dst`` (a flat uint8 region)."""

    src: torch.Tensor
    dst: torch.Tensor
    start: int
    stop: int


def _copy_cpu(job: CopyJob) -> None:
    n = job.stop - job.start
    if n <= 0:
        return
    src = job.src
    if src.is_contiguous():
        ctypes.memmove(job.dst.data_ptr() + job.start, src.data_ptr() + job.start, n)
    else:  # never split (the planner keeps it whole): copy with its strides
        job.dst.view(src.dtype).view(src.shape).copy_(src)


class CopyEngine:
    """Runs copy jobs; ``wait`` is the only call that blocks training.

    Args:
        mode: ``"thread"`` (default) or ``"inline"`` for CPU sources.
    """

    def __init__(self, mode: str = "thread") -> None:
        """Start the worker thread (thread mode)."""
        if mode not in ("thread", "inline"):
            raise ValueError(f"copy mode must be 'thread' or 'inline', got {mode!r}")
        self.mode = mode
        self.busy_seconds = 0.0
        self.bytes_copied = 0
        self._queue: queue.SimpleQueue[list[CopyJob] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._outstanding = 0
        self._error: BaseException | None = None
        self._stream: Any = None
        self._events: list[Any] = []
        self._thread: threading.Thread | None = None
        if mode == "thread":
            self._thread = threading.Thread(target=self._run, name="asymcheck-copy", daemon=True)
            self._thread.start()

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
                _copy_cpu(job)
            self.busy_seconds += time.perf_counter() - started
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
            try:
                for job in batch:
                    _copy_cpu(job)
            except BaseException as exc:  # reported by wait()
                logger.exception("copy failed")
                self._error = exc
            elapsed = time.perf_counter() - started
            with self._cond:
                self.busy_seconds += elapsed
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
            self._cond.wait_for(lambda: self._outstanding == 0)
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
        if not self._events:
            return None
        last = self._events[-1]
        self._events.clear()
        torch.cuda.current_stream().wait_event(last)  # step t+1 must not overwrite before the copy
        return last

    def close(self) -> None:
        """Stop the worker after the queued copies."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
