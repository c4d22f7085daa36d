"""The host pipeline: one version's segments hashed and written by a bounded pool of threads.

With one thread (``AsymStore(pipeline_threads=1)``) a tier's segments go as they always did: the
next segment is filled (chunks gathered, compressed, hashed) in a worker thread while the previous
one is written. With ``n > 1`` threads, :func:`stream_pooled` lays segments out in order on the pool
(cheap for raw chunks: views of the staged bytes; chunks to compress are encoded ahead of it on the
other threads), then hands each one to the pool, where a thread
hashes it and, for a tier whose writer takes writes from threads (:class:`~asymstore.tiers.protocol.
ThreadedWriter`: ``LocalTier`` and the shared-memory ``host_tier``), writes it, several segments at once.
Other tiers get their segments hashed in the pool and written one at a time, in order, as before.

The segments, their checksums and the manifest are the same bytes whatever the number of threads:
segment boundaries come from the tier plan alone, and each segment's checksum comes from its
chunks' checksums when it is laid out (format 5, no pass over its bytes), or for a tier that needs
the ``"bytes"`` proof (a peer) is one xxh3 pass over its parts in order, taken by whichever thread
writes it.

Memory: segments in flight (laid out and not yet written) and chunks encoded ahead (their raw
bytes) hold at most ``flush_memory_bytes`` between them (one segment at least), the same budget
that caps the segment size at half of it; :attr:`~asymstore.values.FlushStats.inflight_peak_bytes`
reports the most that were.

Why threads: xxhash, zstd, ``os.write``/``writev``, ``ctypes.memmove`` and torch copies release
the GIL while they run on large buffers (a Python thread beside them keeps running), so the threads
work in parallel; ``bytes.join`` and memoryview slice assignment hold it (the pipeline avoids them
for large buffers). How to size the pool: docs/concepts/batching.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from asymstore.errors import AsymstoreError, TierError
from asymstore.format.checksum import StreamingChecksum
from asymstore.tiers.protocol import ThreadedWriter, VersionWriter
from asymstore.write.segments import SEGMENT_ALIGN, Segment, SegmentBuilder

T = TypeVar("T")
logger = logging.getLogger(__name__)

MAX_DEFAULT_THREADS = 8
"""The most threads :func:`default_threads` gives: past about this many, one host's memory bandwidth is spent."""


CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
"""cgroup v2's CPU quota of this process's group: ``"<quota> <period>"`` or ``"max <period>"``."""


def quota_cpus(path: str = CGROUP_CPU_MAX) -> int | None:
    """CPUs a cgroup v2 quota allows (rounded up), or None: no quota, no cgroup v2, or unreadable."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def host_cpus() -> int:
    """The CPUs this process may run on: its affinity (the CPU count where unknown), within its cgroup's quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = quota_cpus()
    return min(cpus, quota) if quota is not None else cpus


def local_ranks() -> int:
    """Processes of this job on this host, from the launcher's ``LOCAL_WORLD_SIZE`` (1 when not set)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_threads(cpus: int | None = None, ranks: int | None = None) -> int:
    """The pipeline threads of one store when ``pipeline_threads`` is not given.

    Half of this process's share of the host's CPUs (:func:`host_cpus`
    divided by the job's processes on this host), at most :data:`MAX_DEFAULT_THREADS`,
    at least 1: the other half stays with training (its main thread, data
    loader workers, the CUDA driver), so the pipeline is never in its way.
    A 2-core machine gets 1 thread (the pipeline as it was before the pool);
    a 16-core single-GPU host gets 8.
    """
    cpus = host_cpus() if cpus is None else cpus
    ranks = local_ranks() if ranks is None else ranks
    return max(1, min(MAX_DEFAULT_THREADS, cpus // (2 * max(ranks, 1))))


class SegmentPool:
    """A bounded pool of ``threads`` worker threads shared by every tier write of one store.

    Threads start on first use; :meth:`close` stops them. With one thread
    the store does not use the pool at all (see the module docstring).

    Args:
        threads: worker threads (at least 1).
    """

    def __init__(self, threads: int) -> None:
        """Create the pool; no thread starts before the first task."""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"pipeline threads must be an int >= 1, got {threads!r}")
        self.threads = threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        """Return a short description."""
        return f"SegmentPool(threads={self.threads})"

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.threads, thread_name_prefix="asymstore-pipeline")
            return self._executor

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on a pool thread; return its future (wait for it from any thread)."""
        return self._pool().submit(fn)

    def run(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` on a pool thread; return a future of the running loop."""
        return asyncio.wrap_future(self.submit(fn))

    def close(self) -> None:
        """Stop the threads once their tasks are done (a later :meth:`run` starts new ones)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)


def _hash(seg: Segment) -> str:
    return StreamingChecksum(seg.parts).hexdigest()


async def stream_pooled(builder: SegmentBuilder, writer: VersionWriter, pool: SegmentPool,
                        memory_bytes: int) -> None:
    """Write ``builder``'s segments with ``pool``: laid out in order, hashed and written several at once.

    At most ``pool.threads`` segments are hashed or written at a time; chunks
    planned compressed are encoded ahead of the layout on the pool's threads
    (:meth:`SegmentBuilder.encode_ahead`). The segments in flight (laid out,
    not yet written) and the chunks encoded ahead hold at most ``memory_bytes``
    between them (raw bytes counted for the chunks), one segment at least. On a failure no new segment starts,
    the ones in flight finish, and the first error is raised (an
    :class:`~asymstore.errors.AsymstoreError` as it is, an ``OSError`` of a
    write as :class:`~asymstore.errors.TierError`); the caller aborts the version.
    """
    stats = builder.stats
    stats.pipeline_threads = pool.threads
    # a writer whose write_segment was replaced on the instance (a wrapper, a test's slow disk) goes through it
    threaded = isinstance(writer, ThreadedWriter) and "write_segment" not in getattr(writer, "__dict__", {})
    limit = max(memory_bytes, 1)
    # the largest segment the layout can make: B (plus the padding before its last chunk), or one chunk alone
    biggest = max(builder.tier_plan.segment_bytes + SEGMENT_ALIGN, max(map(len, builder.plan.views), default=0))
    inflight: dict[asyncio.Future[float], int] = {}  # hash (and write) of one segment -> its bytes
    held = 0
    ordered: asyncio.Future[None] | None = None  # the previous in-order write (writers without threads)
    failure: BaseException | None = None

    def task(seg: Segment, index: int) -> Callable[[], float]:
        def work() -> float:
            if not seg.checksum:  # the "bytes" proof: one pass over the segment, on this thread
                builder.settle(index, _hash(seg))
            if not threaded:
                return 0.0
            assert isinstance(writer, ThreadedWriter)
            t0 = time.perf_counter()
            writer.write_segment_blocking(seg.name, seg.parts)
            return time.perf_counter() - t0
        return work

    async def write_in_order(before: asyncio.Future[None] | None, hashed: asyncio.Future[float],
                             seg: Segment) -> None:
        waited = await asyncio.gather(*([before] if before is not None else []), hashed, return_exceptions=True)
        for result in waited:
            if isinstance(result, BaseException):
                raise result
        t0 = time.perf_counter()
        await writer.write_segment(seg.name, seg.parts)
        stats.write_seconds += time.perf_counter() - t0

    async def settle_one() -> None:
        nonlocal held, failure
        done, _ = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            held -= inflight.pop(fut)
            try:
                stats.write_seconds += fut.result()
            except BaseException as exc:  # kept, raised once the rest are done
                if failure is None:
                    failure = exc

    try:
        while failure is None:
            while inflight and (len(inflight) >= pool.threads or held + builder.ahead_bytes + biggest > limit):
                await settle_one()
                if failure is not None:
                    break
            if failure is not None:
                break
            # chunks to compress are encoded ahead on the other threads, within what the budget leaves
            ahead = builder.encode_ahead(pool.submit, limit - held - biggest)
            stats.inflight_peak_bytes = max(stats.inflight_peak_bytes, held + ahead)
            laid = await pool.run(builder.next_layout)
            if laid is None:
                break
            seg, index = laid
            fut = pool.run(task(seg, index))
            if not threaded:  # hashed in the pool, written in order on the loop
                ordered = asyncio.ensure_future(write_in_order(ordered, fut, seg))
                inflight[_as_float(ordered)] = seg.size
            else:
                inflight[fut] = seg.size
            held += seg.size
            stats.inflight_peak_bytes = max(stats.inflight_peak_bytes, held + builder.ahead_bytes)
        while inflight:
            await settle_one()
    finally:
        # a failure or a cancel: the threads finish what they started before the caller aborts the version
        running = [asyncio.wrap_future(fut) for fut in builder.drop_ahead()]
        if inflight or running:
            await asyncio.shield(asyncio.gather(*inflight, *running, return_exceptions=True))
    if failure is not None:
        if isinstance(failure, AsymstoreError) or not isinstance(failure, OSError):
            raise failure
        raise TierError(f"{stats.tier}: writing a segment: {failure}") from failure


def _as_float(fut: asyncio.Future[None]) -> asyncio.Future[float]:
    """An in-order write's future, as the pool's (its result counts no write time: it was counted already)."""
    out: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    def done(f: asyncio.Future[None]) -> None:
        if out.done():
            return
        if f.cancelled():
            out.cancel()
        elif (exc := f.exception()) is not None:
            out.set_exception(exc)
        else:
            out.set_result(0.0)
    fut.add_done_callback(done)
    return out
