"""The Checkpointer: per-iteration snapshots of a plain PyTorch training loop into asymstore."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

import torch

from asymcheck.commits import CommitQueue
from asymcheck.copyengine import CopyEngine
from asymcheck.errors import CheckpointerStateError, CommitFailedError, StepConflictError
from asymcheck.hooks import HookSet
from asymcheck.hostpool import HostPool
from asymcheck.partition import BACKWARD, FORWARD, Clock, PerfCounterClock, Plan, Planner, WindowRecorder
from asymcheck.snapshot import Snapshot, extents_of
from asymcheck.state import Stateful, TrainingState
from asymcheck.stats import CheckpointStats, StatsRecorder, StepRecord
from asymcheck.storeloop import StoreLoop
from asymstore import AsymStore, LocalTier, NoCheckpointError, Tier

logger = logging.getLogger(__name__)

StoreSpec = AsymStore | Sequence[Tier] | str | os.PathLike[str]


@dataclass(frozen=True)
class RestoreInfo:
    """Where ``resume()`` found its version.

    Attributes:
        step: the version restored (optimizer steps completed).
        tier: the tier it was read from.
        fallbacks: newer versions or faster copies that failed verification first.
    """

    step: int
    tier: str
    fallbacks: tuple[str, ...]


def _make_store(spec: StoreSpec, keep_last: int | None) -> AsymStore:
    if isinstance(spec, AsymStore):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:  # DDP: one shard per rank, a global commit
            from asymstore.multirank import RankStore

            return RankStore(spec, keep_last=keep_last)
        return AsymStore([LocalTier(spec)], keep_last=keep_last)
    return AsymStore(list(spec), keep_last=keep_last)


def _on_cuda(model: torch.nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())


class Checkpointer:
    """Snapshots every ``every``-th optimizer step of an ordinary training loop.

    The state of step ``t`` (parameters, optimizer state, param groups, the
    ``stateful`` objects, RNG states) is copied to host memory during the
    forward and backward passes of iteration ``t + 1``, in partitions sized
    to the idle windows between hooks; the optimizer's step pre-hook copies
    what is left and waits (the only stall), then the version is committed to
    the store in the background. Versions are numbered by optimizer steps
    completed. The last step is captured by :meth:`close`, so use the
    Checkpointer as a context manager.

    ::

        with Checkpointer(model, opt, "ckpt", stateful={"sched": sched}) as ckpt:
            start = ckpt.resume() or 0
            for step in range(start, total):
                loss = model(batch(step)).loss
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

    What is captured when: parameters and optimizer tensors are only changed
    by ``optimizer.step()``, so they are read lazily until the next step.
    Buffers and RNG states are copied right after the step. Param groups and
    ``stateful`` objects are captured at the first forward or backward hook
    of the next iteration (or its step, or ``close()``), i.e. after the loop's
    ``scheduler.step()`` / ``scaler.update()``. A data position kept in
    ``stateful`` must therefore count the batches of completed iterations
    (advance it at the end of the loop body), and data loading before the
    forward must not draw from the global RNG after the step's capture.

    Args:
        model: the module trained.
        optimizer: its optimizer.
        store_or_tiers: an unopened :class:`asymstore.AsymStore` (the
            Checkpointer opens and closes it), a list of tiers (fastest
            first), or a directory path (a single ``LocalTier``; in a
            torch.distributed job of several ranks, an
            :class:`asymstore.multirank.RankStore` there: one shard per
            rank, published globally once every rank committed).
        stateful: name -> object with ``state_dict``/``load_state_dict``
            (LR scheduler, GradScaler, sampler, data position).
        every: snapshot every ``every``-th optimizer step.
        keep_last: versions kept per tier (when the store is built here).
        max_inflight: background commits running at once.
        when_busy: when a version is sealed while ``max_inflight`` commits
            run: ``"wait"`` (back-pressure) or ``"skip"`` the version.
        host_slots: host staging buffers (each the size of the flat state).
        copy: ``"thread"`` (a copy thread) or ``"inline"`` (copy inside the hooks).
        warmup: iterations measured before partitions are sized.
        max_partitions: soft limit on partitions per version.
        min_partition_bytes: smallest partition worth a separate copy.
        replan_tolerance: relative drift of the windows that triggers a re-plan.
        clock: timing source for windows (default: CUDA events for a CUDA
            model, ``perf_counter`` otherwise).
        on_error: a failed background commit is ``"raise"``-d (as
            :class:`CommitFailedError` at the next step) or only ``"log"``-ged.
        save_on_close: ``close()`` saves the final step even when it is not
            a multiple of ``every``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, store_or_tiers: StoreSpec, *,
                 stateful: Mapping[str, Stateful] | None = None, every: int = 1, keep_last: int | None = 3,
                 max_inflight: int = 1, when_busy: str = "wait", host_slots: int = 2, copy: str = "thread",
                 warmup: int = 3, max_partitions: int = 16, min_partition_bytes: int = 1 << 20,
                 replan_tolerance: float = 0.25, clock: Clock | None = None, on_error: str = "raise",
                 save_on_close: bool = True) -> None:
        """Open the store on its own thread and register the hooks."""
        if every < 1:
            raise ValueError("every must be >= 1")
        if on_error not in ("raise", "log"):
            raise ValueError(f"on_error must be 'raise' or 'log', got {on_error!r}")
        self.state = TrainingState(model, optimizer, stateful)
        self.every = every
        self.on_error = on_error
        self.save_on_close = save_on_close
        cuda = _on_cuda(model)
        if clock is None:
            if cuda:
                from asymcheck.cudaclock import CudaEventClock
                clock = CudaEventClock()
            else:
                clock = PerfCounterClock()
        self._stats = StatsRecorder()
        self._planner = Planner(warmup=warmup, tolerance=replan_tolerance, max_partitions=max_partitions,
                                min_bytes=min_partition_bytes)
        self._recorder = WindowRecorder(clock)
        self._pool = HostPool(host_slots, pin=cuda)
        self._loop = StoreLoop(_make_store(store_or_tiers, keep_last))
        try:
            self._commits = CommitQueue(self._loop, self._stats, max_inflight=max_inflight, when_busy=when_busy)
            self._engine = CopyEngine(copy)
        except BaseException:
            self._loop.close()
            raise
        self._step = 0
        self._saved_step: int | None = None  # newest step restored or handed to a commit
        self._snap: Snapshot | None = None
        self._in_step = False
        self._started = False
        self._checked_store = False
        self._conflict = False
        self._closed = False
        self._hook_s = 0.0
        self._open_s = 0.0
        self._last_pre: float | None = None
        self._copy_mark = 0.0
        self.restored: RestoreInfo | None = None
        self.final_versions: dict[str, list[int]] | None = None  # store.versions() when closed
        self._hooks = HookSet(model, optimizer, on_forward=self._on_forward, on_grad=self._on_grad,
                              on_step_pre=self._on_step_pre, on_step_post=self._on_step_post)

    # -- public ----------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps completed (including those before a resume)."""
        return self._step

    @property
    def plan(self) -> Plan | None:
        """The partition plan of the newest version (None before the first step)."""
        return self._planner.current

    @property
    def store(self) -> AsymStore:
        """The store (runs on the Checkpointer's thread; do not call it from another loop)."""
        return self._loop.store

    def versions(self) -> dict[str, list[int]]:
        """Committed versions per tier name."""
        return self._loop.run(_versions(self._loop.store))

    @property
    def last_record(self) -> StepRecord | None:
        """The newest step's record (cheaper than ``stats()`` inside a training loop)."""
        return self._stats.steps[-1] if self._stats.steps else None

    def stats(self) -> CheckpointStats:
        """Stall, copy time and bytes per step, and commit counters, so far."""
        return self._stats.snapshot(self._engine.busy_seconds, self._engine.bytes_copied, self._planner.replans)

    def resume(self) -> int | None:
        """Load the newest version that verifies into the live objects.

        Call before the first optimizer step. A damaged newest version is
        skipped in favour of the one before (see ``restored.fallbacks``).

        Returns:
            The restored step (optimizer steps completed), or None when the
            store holds no version (a fresh start; nothing is changed).

        Raises:
            StateMismatchError: the version does not fit the model, optimizer
                or stateful objects; nothing was loaded.
            CorruptVersionError: no version verifies.
            CheckpointerStateError: training already started, or closed.
        """
        self._require_open()
        if self._started:
            raise CheckpointerStateError("resume() must be called before the first optimizer step")
        try:
            ckpt = self._loop.run(self._loop.store.restore())
        except NoCheckpointError:
            logger.info("no checkpoint in the store: starting fresh")
            self._checked_store = True
            return None
        self.state.load(ckpt.tensors, ckpt.meta)
        self._step = self._saved_step = ckpt.step
        self._checked_store = True
        self.restored = RestoreInfo(ckpt.step, ckpt.tier, tuple(ckpt.fallbacks))
        logger.info("resumed step %d from %s%s", ckpt.step, ckpt.tier,
                    f" after {len(ckpt.fallbacks)} fallback(s)" if ckpt.fallbacks else "")
        return ckpt.step

    def flush(self) -> None:
        """Wait until every sealed version is committed."""
        self._commits.drain()
        self._raise_commit_error()

    def close(self) -> None:
        """Capture the last step (if not saved), commit it, wait for every commit, release everything.

        Raises:
            CommitFailedError: a commit failed (with ``on_error="raise"``).
        """
        self._close(save=True)

    def __enter__(self) -> Checkpointer:
        """Return self."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close; on an exception, save what is consistent and never mask the exception."""
        if exc is None:
            self.close()
            return
        try:
            self._close(save=True)
        except Exception as close_exc:
            logger.error("closing after %s: %s", exc_type.__name__ if exc_type else "error", close_exc)

    # -- hooks -----------------------------------------------------------

    def _on_forward(self) -> None:
        self._event(FORWARD)

    def _on_grad(self) -> None:
        self._event(BACKWARD)

    def _event(self, phase: str) -> None:
        if self._closed:
            return
        started = time.perf_counter()
        ordinal = self._recorder.enter(phase)
        snap = self._snap
        if snap is not None:
            if snap.next_pending:
                snap = self._snap = self._capture_next(snap)
            snap.issue_event(ordinal, self._engine)
        self._recorder.leave()
        self._hook_s += time.perf_counter() - started

    def _on_step_pre(self) -> None:
        if self._closed:
            return
        started = time.perf_counter()
        for windows in self._recorder.finish():
            self._planner.observe(windows)
        self._raise_commit_error()
        self._in_step = True
        snap, self._snap = self._snap, None
        sealed = skipped = False
        waited = 0.0
        nbytes = 0
        if snap is not None:
            submitted, waited, nbytes = self._seal(snap)
            sealed, skipped = True, not submitted
        ended = time.perf_counter()
        iteration = started - self._last_pre if self._last_pre is not None else 0.0
        self._last_pre = started
        busy = self._engine.busy_seconds
        self._stats.add_step(StepRecord(
            step=self._step, sealed=sealed, stall_s=ended - started, backpressure_s=waited, hook_s=self._hook_s,
            open_s=self._open_s, copy_bytes=nbytes, iteration_s=iteration, skipped=skipped,
            copy_s=busy - self._copy_mark))
        self._copy_mark = busy
        self._hook_s = self._open_s = 0.0

    def _on_step_post(self) -> None:
        if self._closed:
            return
        started = time.perf_counter()
        self._in_step = False
        self._started = True
        self._step += 1
        self._hooks.refresh()
        if self._step % self.every == 0:
            self._open(self._step)
        self._recorder.start()
        self._open_s = time.perf_counter() - started

    # -- versions --------------------------------------------------------

    def _open(self, step: int) -> None:
        if not self._checked_store:
            newest = self._loop.store.newest_step
            if newest is not None and step <= newest:
                self._conflict = True  # nothing of this run is written, not even by close()
                raise StepConflictError(f"the store already holds step {newest} and this run is at step {step}: "
                                        "call resume() first, or use a fresh directory")
            self._checked_store = True
        cap = self.state.capture_step()
        plan = self._planner.plan(extents_of(cap.sources))
        slot = self._pool.acquire()
        assert slot is not None
        slot.arrange(cap.sources)
        self._snap = Snapshot(step, cap, plan, slot)
        self._stats.versions_opened += 1

    def _capture_next(self, snap: Snapshot) -> Snapshot:
        """Capture param groups and stateful objects; re-open the version if parameters were added."""
        if self.state.signature() != snap.capture.signature:
            # parameters, buffers or param groups were added or replaced after the step (before any
            # partition was issued): re-capture so the version stays one consistent state
            logger.info("model or optimizer changed after step %d: re-capturing its version", snap.step)
            cap = self.state.capture_step(rng_from=snap.capture)
            plan = self._planner.plan(extents_of(cap.sources))
            snap.slot.arrange(cap.sources)
            snap = Snapshot(snap.step, cap, plan, snap.slot)
            self._hooks.refresh()
        self.state.capture_next(snap.capture)
        snap.next_pending = False
        return snap

    def _seal(self, snap: Snapshot, *, force: bool = False) -> tuple[bool, float, int]:
        """Copy what is left, wait for the copies, and hand the version to the commit queue."""
        if snap.next_pending:
            snap = self._capture_next(snap)
        snap.issue_rest(self._engine)
        ready = self._engine.wait()
        meta = snap.capture.meta
        meta["asymcheck"]["step"] = snap.step
        meta["asymcheck"]["plan"] = {"generation": snap.plan.generation, "warm": snap.plan.warm,
                                     "partitions": len(snap.plan.partitions)}
        slot = snap.slot
        submitted, waited = self._commits.submit(snap.step, snap.tensors(), meta, ready,
                                                 lambda: self._pool.release(slot), force=force)
        self._stats.versions_sealed += 1
        if submitted:
            self._saved_step = snap.step
        else:
            self._stats.versions_skipped += 1
        return submitted, waited, snap.nbytes

    def _raise_commit_error(self) -> None:
        exc = self._commits.take_error()
        if exc is not None and self.on_error == "raise":
            raise CommitFailedError(f"a background commit failed: {type(exc).__name__}: {exc}") from exc

    def _require_open(self) -> None:
        if self._closed:
            raise CheckpointerStateError("the Checkpointer is closed")

    def _close(self, *, save: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            snap, self._snap = self._snap, None
            if save and not self._in_step and not self._conflict:
                if snap is not None:
                    self._seal(snap, force=True)
                elif self.save_on_close and self._step > 0 and self._step != self._saved_step:
                    self._open(self._step)
                    snap, self._snap = self._snap, None
                    assert snap is not None
                    self._seal(snap, force=True)
            elif snap is not None:
                self._pool.release(snap.slot)
            self._commits.drain()
            self.final_versions = self._loop.run(_versions(self._loop.store))
        finally:
            self._hooks.remove()
            self._engine.close()
            self._loop.close()
        self._raise_commit_error()


async def _versions(store: AsymStore) -> dict[str, list[int]]:
    return store.versions()
