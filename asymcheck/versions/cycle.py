"""The life of one version inside the Checkpointer: open at the step, re-capture, finish the copy, seal or drop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from asymcheck.errors import StepConflictError
from asymcheck.snapshot.copyengine import CopyEngine
from asymcheck.snapshot.edits import EditTracker
from asymcheck.snapshot.frozen import FrozenTensors, FrozenUse
from asymcheck.snapshot.hostpool import HostPool, HostSlot
from asymcheck.snapshot.partition import Planner
from asymcheck.snapshot.version import Snapshot, extents_of
from asymcheck.state.dtensors import check_tensors
from asymcheck.state.replicas import ReplicaSlicer
from asymcheck.state.trainstate import Capture, Moment, TrainingState
from asymcheck.stats import StatsRecorder
from asymcheck.versions.commits import CommitQueue
from asymcheck.versions.progress import Progress
from asymstore.format.pieces import LAYOUT_KEY
from asymstore.protocols import CheckpointStore
from asymstore.runtime.loop import StoreLoop
from asymstore.values import KnownChunks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sealed:
    """What sealing one version did.

    Attributes:
        submitted: handed to the commit queue.
        waited: seconds of back-pressure (an earlier commit still running: waiting for its slot, or to submit).
        nbytes: bytes of the flat state.
        dropped: not committed, because a captured tensor changed before its copy.
        by_phase: bytes issued by forward hooks, backward hooks and at the step boundary
            (``"forward"``, ``"backward"``, ``"drain"``).
    """

    submitted: bool
    waited: float
    nbytes: int
    dropped: bool
    by_phase: Mapping[str, int]


class VersionCycle:
    """Opening, re-capturing, finishing and sealing the versions of one :class:`asymcheck.Checkpointer`.

    A version opens when the step returns (flat state referenced, buffers and
    the moment copied), takes its late state at the first training hook of the
    next iteration (re-capturing first if parameters were added), has its copy
    finished and checked by ``editing()`` or the seal, and is then committed in
    the background, or dropped when a captured tensor changed before its copy.

    Args:
        state: the training state it captures.
        progress: the loop's position, shared with the Checkpointer.
        edits: the tracker of edits between steps.
        planner: the partition planner.
        pool: the host slots versions are copied into.
        engine: the copy engine.
        commits: the queue sealed versions go to.
        stats: where opened, sealed and skipped versions are counted.
        loop: the store's loop (for the newest step it holds).
        on_recapture: called when a version was re-captured because
            parameters were added after the step (the hooks must follow them).
        save_on_close: seal the newest completed step on close if no version of it is open.
        replicas: cuts each version's replicated state into this rank's slice (None: never).
        frozen: the host copies of frozen parameters known unchanged (None: every version copies all).
    """

    def __init__(self, state: TrainingState, progress: Progress, *, edits: EditTracker, planner: Planner,
                 pool: HostPool, engine: CopyEngine, commits: CommitQueue, stats: StatsRecorder,
                 loop: StoreLoop[CheckpointStore], on_recapture: Callable[[], None], save_on_close: bool,
                 replicas: ReplicaSlicer | None = None, frozen: FrozenTensors | None = None) -> None:
        self.state = state
        self.progress = progress
        self.edits = edits
        self.planner = planner
        self.pool = pool
        self.engine = engine
        self.commits = commits
        self.stats = stats
        self.loop = loop
        self.on_recapture = on_recapture
        self.save_on_close = save_on_close
        self.replicas = replicas
        self.frozen = frozen
        self.uses: dict[int, FrozenUse] = {}  # per open version (step): what it takes from ``frozen``
        self.snap: Snapshot | None = None
        """The open version, if any."""
        self.moment: Moment | None = None
        """RNG and data states taken when the step returned (DeepSpeed), for the next version to open."""
        self.checked_store = False  # the store's newest step was compared with this run's (or resumed)
        self.conflict = False  # the store is ahead of this run: nothing of it is written
        self.metrics: dict[int, dict[str, float]] = {}
        """Metrics logged per completed step (``Checkpointer.log_metrics``): the step's version carries them."""

    def take_moment(self) -> Moment | None:
        """The moment taken when the step returned, once (None if none was)."""
        moment, self.moment = self.moment, None
        return moment

    def open(self, step: int) -> None:
        """Open the version of ``step``.

        Raises:
            StepConflictError: the store already holds this step or a newer one (and this run did not resume).
        """
        if not self.checked_store:
            newest = self.loop.store.newest_step
            if newest is not None and step <= newest:
                self.conflict = True  # nothing of this run is written, not even by close()
                raise StepConflictError(f"the store already holds step {newest} and this run is at step {step}: "
                                        "call resume() first, or use a fresh directory")
            self.checked_store = True
        cap = self.state.capture_step(self.take_moment())
        if self.replicas is not None:
            self.replicas.apply(cap, step)
        if self.edits.eager:
            cap.make_eager(self.edits.eager)
        self._select_frozen(step, cap)
        plan = self.planner.plan(extents_of(cap.sources))
        slot = self.pool.acquire(timeout=0)  # none free: the hooks take one once an earlier commit gives it back
        if slot is not None:
            slot.arrange(cap.sources)
        self.snap = Snapshot(step, cap, plan, slot, self._acquire)
        self.stats.versions_opened += 1

    def _select_frozen(self, step: int, cap: Capture) -> None:
        """Take the frozen parameters known unchanged out of ``cap`` (the version takes their host copies)."""
        self.uses.clear()  # one version is open at a time
        if self.frozen is not None:
            self.uses[step] = self.frozen.select(cap, self.state.optimizer)

    def _acquire(self, wait: bool) -> HostSlot | None:
        """A free host slot: waiting for one (back-pressure: an earlier commit still holds them), or None now."""
        return self.pool.acquire(None if wait else 0)

    def _release(self, snap: Snapshot) -> None:
        if snap.slot is not None:
            self.pool.release(snap.slot)

    def capture_next(self, snap: Snapshot) -> Snapshot:
        """Capture param groups and stateful objects; re-open the version if parameters were added."""
        if self.state.signature() != snap.capture.signature and not snap.issued_bytes:
            # parameters, buffers or param groups were added or replaced after the step (before any
            # partition was issued): re-capture so the version stays one consistent state
            logger.info("model or optimizer changed after step %d: re-capturing its version", snap.step)
            check_tensors(self.state.model, self.state.optimizer)  # no unsupported tensor added since
            cap = self.state.capture_step(Moment.of(snap.capture))
            if self.replicas is not None:
                self.replicas.apply(cap, snap.step)
            if self.edits.eager:
                cap.make_eager(self.edits.eager)
            self._select_frozen(snap.step, cap)
            plan = self.planner.plan(extents_of(cap.sources))
            if snap.slot is not None:
                snap.slot.arrange(cap.sources)
            snap = Snapshot(snap.step, cap, plan, snap.slot, self._acquire)
            self.on_recapture()
        self.state.capture_next(snap.capture)
        snap.next_pending = False
        return snap

    def finish_copy(self, snap: Snapshot) -> None:
        """Copy what is left of ``snap``, wait, and check which tensors changed before their copy."""
        snap.issue_rest(self.engine)
        snap.ready = self.engine.wait()
        snap.verify(self.engine.take_bad())

    def seal(self, snap: Snapshot, *, force: bool = False) -> Sealed:
        """Finish the copy and hand the version to the commit queue, or drop it if it is not clean."""
        if snap.next_pending:
            snap = self.capture_next(snap)
        if (not force and self.commits.when_busy == "skip" and not snap.verified
                and not snap.take_slot(False)):  # no slot yet: an earlier commit is still running; never wait for it
            logger.info("version %d skipped: no host slot free (an earlier commit is still running)", snap.step)
            self.commits.report_dropped(snap.step, "skipped: earlier commits still in flight")
            self.stats.versions_sealed += 1
            self.stats.versions_skipped += 1
            return Sealed(False, 0.0, snap.nbytes, False, dict(snap.issued_by_phase))
        slot_wait = snap.slot_wait_s
        if not snap.verified:
            self.finish_copy(snap)
        else:
            snap.ready = self.engine.wait() or snap.ready
        slot_wait = snap.slot_wait_s - slot_wait  # inside this seal (the step pre-hook's stall), not editing()'s
        use = self.uses.pop(snap.step, None)
        if use is not None and self.frozen is not None:
            changed = self.frozen.check(use)  # a frozen parameter's bytes at the step differ from its copy
            if changed:
                self._release(snap)
                self.commits.report_dropped(snap.step, f"{len(changed)} frozen tensor(s) changed without "
                                                       "moving their version counter")
                self.edits.dropped += 1
                return Sealed(False, 0.0, snap.nbytes, True, dict(snap.issued_by_phase))
        if snap.dirty:
            self._release(snap)
            self.edits.dropped_version(snap.step, snap.dirty)
            self.commits.report_dropped(snap.step, f"{len(snap.dirty)} tensor(s) changed before their copy")
            return Sealed(False, 0.0, snap.nbytes, True, dict(snap.issued_by_phase))
        meta = snap.capture.meta
        metrics = self.metrics.pop(snap.step, None)
        for old in [s for s in self.metrics if s < snap.step]:  # steps whose version was not taken
            del self.metrics[old]
        if metrics:
            meta["metrics"] = metrics
        if self.replicas is not None:  # the claim of a version of slices (asymstore.format.replicas)
            self.replicas.finish(snap.step, meta)
        meta["asymcheck"]["step"] = snap.step
        meta["asymcheck"]["plan"] = {"generation": snap.plan.generation, "warm": snap.plan.warm,
                                     "partitions": len(snap.plan.partitions),
                                     "partitioning": snap.plan.partitioning}
        tensors = snap.tensors()  # the slot is there: every partition was issued
        slot = snap.slot
        assert slot is not None
        known: dict[str, KnownChunks] = {}
        if use is not None and self.frozen is not None:
            self.frozen.learn(snap, use)  # before the slot is handed to the commit (and reused)
            plain, known = self.frozen.tensors(use)
            tensors.update(plain)
        layouts = self.state.layout_meta(tensors, snap.capture)
        if layouts is not None:  # where each tensor sits in its global tensor (asymstore.format.pieces)
            meta[LAYOUT_KEY] = layouts
        submitted, waited = self.commits.submit(snap.step, tensors, meta, snap.ready,
                                                 lambda: self.pool.release(slot), force=force, known=known)
        self.stats.versions_sealed += 1
        if submitted:
            self.progress.saved_step = snap.step
        else:
            self.stats.versions_skipped += 1
        return Sealed(submitted, waited + slot_wait, snap.nbytes, False, dict(snap.issued_by_phase))

    def seal_last(self, save: bool) -> None:
        """Seal the open version, or the newest completed step if none is open and it was not saved."""
        snap, self.snap = self.snap, None
        if save and not self.progress.in_step and not self.conflict:
            step = self.progress.step
            if snap is None and self.save_on_close and step > 0 and step != self.progress.saved_step:
                self.open(self.progress.step)
                snap, self.snap = self.snap, None
            if snap is not None:
                self.seal(snap, force=True)
        elif snap is not None:
            self._release(snap)
