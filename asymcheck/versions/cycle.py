"""The life of one version inside the Checkpointer: open at the step, re-capture, finish the copy, seal or drop."""

from __future__ import annotations

import logging

from asymcheck.errors import StepConflictError
from asymcheck.policy.preempt import SigtermNotice
from asymcheck.snapshot.copyengine import CopyEngine
from asymcheck.snapshot.edits import EditTracker
from asymcheck.snapshot.hooks import HookSet
from asymcheck.snapshot.hostpool import HostPool
from asymcheck.snapshot.partition import Planner
from asymcheck.snapshot.version import Snapshot, extents_of
from asymcheck.state.dtensors import check_tensors
from asymcheck.state.trainstate import Moment, TrainingState
from asymcheck.stats import StatsRecorder
from asymcheck.versions.commits import CommitQueue
from asymcheck.versions.storeloop import StoreLoop
from asymstore.format.pieces import LAYOUT_KEY

logger = logging.getLogger(__name__)


class VersionCycle:
    """Opening, re-capturing, finishing and sealing versions; the :class:`asymcheck.Checkpointer` is one.

    A version opens when the step returns (flat state referenced, buffers and
    the moment copied), takes its late state at the first training hook of the
    next iteration (re-capturing first if parameters were added), has its copy
    finished and checked by ``editing()`` or the seal, and is then committed in
    the background, or dropped when a captured tensor changed before its copy.
    """

    state: TrainingState
    _edits: EditTracker
    _planner: Planner
    _pool: HostPool
    _engine: CopyEngine
    _commits: CommitQueue
    _stats: StatsRecorder
    _hooks: HookSet
    _loop: StoreLoop
    _snap: Snapshot | None
    _moment: Moment | None
    _checked_store: bool
    _conflict: bool
    _saved_step: int | None
    _notice: SigtermNotice
    _step: int
    _in_step: bool
    save_on_close: bool

    def _take_moment(self) -> Moment | None:
        moment, self._moment = self._moment, None
        return moment

    def _open(self, step: int) -> None:
        if not self._checked_store:
            newest = self._loop.store.newest_step
            if newest is not None and step <= newest:
                self._conflict = True  # nothing of this run is written, not even by close()
                raise StepConflictError(f"the store already holds step {newest} and this run is at step {step}: "
                                        "call resume() first, or use a fresh directory")
            self._checked_store = True
        cap = self.state.capture_step(self._take_moment())
        if self._edits.eager:
            cap.make_eager(self._edits.eager)
        plan = self._planner.plan(extents_of(cap.sources))
        slot = self._pool.acquire()
        assert slot is not None
        slot.arrange(cap.sources)
        self._snap = Snapshot(step, cap, plan, slot)
        self._stats.versions_opened += 1

    def _capture_next(self, snap: Snapshot) -> Snapshot:
        """Capture param groups and stateful objects; re-open the version if parameters were added."""
        if self.state.signature() != snap.capture.signature and not snap.issued_bytes:
            # parameters, buffers or param groups were added or replaced after the step (before any
            # partition was issued): re-capture so the version stays one consistent state
            logger.info("model or optimizer changed after step %d: re-capturing its version", snap.step)
            check_tensors(self.state.model, self.state.optimizer)  # no unsupported tensor added since
            cap = self.state.capture_step(Moment.of(snap.capture))
            if self._edits.eager:
                cap.make_eager(self._edits.eager)
            plan = self._planner.plan(extents_of(cap.sources))
            snap.slot.arrange(cap.sources)
            snap = Snapshot(snap.step, cap, plan, snap.slot)
            self._hooks.refresh()
        self.state.capture_next(snap.capture)
        snap.next_pending = False
        return snap

    def _finish_copy(self, snap: Snapshot) -> None:
        """Copy what is left of ``snap``, wait, and check which tensors changed before their copy."""
        snap.issue_rest(self._engine)
        snap.ready = self._engine.wait()
        snap.verify(self._engine.take_bad())

    def _seal(self, snap: Snapshot, *, force: bool = False) -> tuple[bool, float, int, bool]:
        """Finish the copy and hand the version to the commit queue, or drop it if it is not clean.

        Returns:
            (submitted, seconds of back-pressure, bytes of the flat state, dropped).
        """
        if snap.next_pending:
            snap = self._capture_next(snap)
        if not snap.verified:
            self._finish_copy(snap)
        else:
            snap.ready = self._engine.wait() or snap.ready
        if snap.dirty:
            self._pool.release(snap.slot)
            self._edits.dropped_version(snap.step, snap.dirty)
            self._commits.report_dropped(snap.step, f"{len(snap.dirty)} tensor(s) changed before their copy")
            return False, 0.0, snap.nbytes, True
        meta = snap.capture.meta
        meta["asymcheck"]["step"] = snap.step
        meta["asymcheck"]["plan"] = {"generation": snap.plan.generation, "warm": snap.plan.warm,
                                     "partitions": len(snap.plan.partitions)}
        slot = snap.slot
        tensors = snap.tensors()
        layouts = self.state.layout_meta(tensors, snap.capture)
        if layouts is not None:  # where each tensor sits in its global tensor (asymstore.format.pieces)
            meta[LAYOUT_KEY] = layouts
        submitted, waited = self._commits.submit(snap.step, tensors, meta, snap.ready,
                                                 lambda: self._pool.release(slot), force=force)
        self._stats.versions_sealed += 1
        if submitted:
            self._saved_step = snap.step
        else:
            self._stats.versions_skipped += 1
        return submitted, waited, snap.nbytes, False

    def _seal_last(self, save: bool) -> None:
        """Seal the open version, or the newest completed step if none is open and it was not saved."""
        snap, self._snap = self._snap, None
        if save and not self._in_step and not self._conflict:
            if snap is None and self.save_on_close and self._step > 0 and self._step != self._saved_step:
                self._open(self._step)
                snap, self._snap = self._snap, None
            if snap is not None:
                self._seal(snap, force=True)
        elif snap is not None:
            self._pool.release(snap.slot)

    def _release(self, *, remove_hooks: bool, timeout: float | None = None) -> bool:
        """Stop the copy thread and close the store (within ``timeout``); True when it closed in time."""
        try:
            if remove_hooks:
                self._hooks.remove()
                self._notice.uninstall()
            self._engine.close()
        finally:
            closed = self._loop.close(timeout, after=self._commits.pending)  # commits in flight end first
        return closed
