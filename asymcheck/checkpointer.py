"""The Checkpointer: per-iteration snapshots of a plain PyTorch training loop into asymstore.

Options are typed groups (:mod:`asymcheck.options`); adapters drive it through ``hooks=`` and ``state=``.
Guide: docs/guides/checkpointer.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, Unpack

import torch

from asymcheck.errors import CheckpointerStateError, InvalidOptionError
from asymcheck.options import (
    CommitOptions,
    CopyMode,
    FailureOptions,
    FlatOptions,
    PacingOptions,
    PartitionOptions,
    PreemptionOptions,
    RetentionOptions,
    WhenBusy,
    renamed_location,
    resolve,
)
from asymcheck.policy.agreement import agreement_for
from asymcheck.policy.failures import FailureBudget
from asymcheck.policy.pacing import Pacer
from asymcheck.policy.preempt import Preemption, PreemptionRecord, SigtermNotice, check_deadline
from asymcheck.restore.exchange import restore_exchanged
from asymcheck.restore.reshard import enable_resharding
from asymcheck.snapshot.copyengine import CopyEngine
from asymcheck.snapshot.edits import EditTracker
from asymcheck.snapshot.frozen import FrozenTensors
from asymcheck.snapshot.hooks import Driver, Hooks, HookSet, HooksFactory
from asymcheck.snapshot.hostpool import HostPool
from asymcheck.snapshot.partition import (
    BACKWARD,
    DRAIN,
    FORWARD,
    Partitioning,
    PerfCounterClock,
    Plan,
    Planner,
    WindowRecorder,
)
from asymcheck.state.dtensors import check_tensors
from asymcheck.state.replicas import REPLICATIONS, Replication, slicer_for
from asymcheck.state.trainstate import Moment, Stateful, TrainingState
from asymcheck.stats import CheckpointStats, StatsRecorder, StepRecord
from asymcheck.versions.commits import CommitQueue
from asymcheck.versions.cycle import VersionCycle
from asymcheck.versions.progress import Progress
from asymcheck.versions.storespec import (
    RestoreInfo,
    StoreSpec,
    layout_recorder,
    on_cuda,
    status_of,
    versions_of,
)
from asymstore import CorruptVersionError, NoCheckpointError
from asymstore.errors import InvalidMetaError
from asymstore.multirank.rootlayout import AcrossLayouts
from asymstore.opener import open_store
from asymstore.protocols import CheckpointStore, KnownBytesStore
from asymstore.runtime.loop import StoreLoop
from asymstore.values import TierStatus

logger = logging.getLogger(__name__)

__all__ = ["Checkpointer", "CopyMode", "RestoreInfo", "StateFactory", "StoreRunner", "StoreSpec", "WhenBusy"]

StoreRunner = Callable[[Coroutine[Any, Any, Any]], Any]
"""Runs a coroutine of the store on the Checkpointer's thread and returns its result."""

StateFactory = Callable[[CheckpointStore, StoreRunner], TrainingState]
"""Builds an adapter's training state from the opened store (``Checkpointer(state=...)``)."""


def _adapter_state(factory: StateFactory, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loop: StoreLoop[CheckpointStore]) -> TrainingState:
    """The state an adapter's factory builds, checked to be of the Checkpointer's model and optimizer."""
    state = factory(loop.store, loop.run)
    if not isinstance(state, TrainingState) or state.model is not model or state.optimizer is not optimizer:
        raise InvalidOptionError("state= must return a TrainingState of the Checkpointer's model and optimizer, "
                                 f"got {state!r}")
    return state


class Checkpointer:
    """Snapshots every ``every``-th optimizer step of an ordinary training loop.

    The state after step ``t`` is copied to host memory during the forward
    and backward passes of iteration ``t + 1``, in partitions sized to the
    idle windows between hooks; the optimizer's step pre-hook copies what is
    left and waits (the only stall), then the version is committed to the
    store in the background. Versions are numbered by optimizer steps
    completed; :meth:`close` (the ``with`` block) captures the last step.

    ::

        with Checkpointer(model, opt, "ckpt", stateful={"sched": sched}, data={"loader": loader}) as ckpt:
            start = ckpt.resume() or 0
            for step in range(start, total):
                loss = model(next(batches)).loss
                loss.backward()
                opt.step()
                evaluate(model)                 # no_grad / eval() forwards are not iteration t+1
                sched.step()
                opt.zero_grad(set_to_none=True)

    When each kind of state is taken (docs/guides/checkpointer.md, "Capture points"): parameters
    and optimizer tensors hold their values when ``optimizer.step()``
    returns (read lazily, checked for edits); buffers, RNG states and the
    ``data`` objects are copied when the step returns; param groups and the
    ``stateful`` objects at the first *training* activity of the next
    iteration (a forward with grad enabled in training mode, a gradient, the
    next step, or ``close()``), i.e. after the loop's ``scheduler.step()`` and
    ``scaler.update()``. Loops that hooks cannot read call :meth:`mark` at the
    end of the loop body; code that edits parameters between steps runs inside
    :meth:`editing`.

    Args:
        model: the module trained.
        optimizer: its optimizer.
        location: where the checkpoint lives: an unopened store (:class:`asymstore.AsymStore`,
            :class:`asymstore.multirank.RankStore`, or any
            :class:`asymstore.protocols.CheckpointStore`; the Checkpointer
            opens and closes it), a list of tiers (fastest
            first), or a directory path (a single ``LocalTier``; in a
            torch.distributed job of several ranks, an
            :class:`asymstore.multirank.RankStore` there).
        stateful: name -> object with ``state_dict``/``load_state_dict`` that the
            loop updates after the step (LR scheduler, GradScaler, counters).
        data: name -> object with ``state_dict``/``load_state_dict`` that
            advances when a batch is drawn (data loader, sampler): taken when the step returns.
        every: snapshot every ``every``-th optimizer step.
        retention: which versions the store keeps, when the store is built here
            (:class:`asymcheck.options.RetentionOptions`; default: the newest 3 per tier).
        partitions: how each version's copy is spread over the next iteration
            (:class:`asymcheck.options.PartitionOptions`; default: asymmetric partitions).
        failures: what a failed background commit does
            (:class:`asymcheck.options.FailureOptions`; default: a budget of 30 minutes without
            a durable version).
        preemption: what SIGTERM does (:class:`asymcheck.options.PreemptionOptions`; default:
            commit the newest step within 25 s, then hand the signal on; the Checkpointer is then
            built on the main thread).
        pacing: which steps become versions beyond ``every``
            (:class:`asymcheck.options.PacingOptions`; default: a 5% step-time budget, and the
            last step saved on close).
        commits: host staging buffers and background commits
            (:class:`asymcheck.options.CommitOptions`; default: two slots, one commit at a time).
        across_layouts: a directory ``location`` whose recorded layout (see
            :mod:`asymstore.multirank.rootlayout`) is single-process, opened by a job of several ranks:
            ``"resume"`` (default) makes :meth:`resume` take its newest version, each rank its part
            (as a version of another world size is resharded), or raise a typed error saying what the
            root holds; ``"start_fresh"`` leaves those versions unread (``resume()`` returns None) and the
            job's multi-rank versions begin beside them. One process opening a multi-rank root always
            resumes it and goes on in the multi-rank layout.
        hooks: for adapters whose framework steps otherwise: a factory that takes the
            Checkpointer's :class:`asymcheck.snapshot.hooks.Driver` and registers the hooks that call
            it (default: :meth:`asymcheck.snapshot.hooks.HookSet.driving` on ``model`` and ``optimizer``).
        state: for adapters with their own kind of state: a factory that takes the opened store and a
            function running a store coroutine on the Checkpointer's thread, and returns the
            :class:`asymcheck.state.trainstate.TrainingState` of ``model`` and ``optimizer`` (it then
            holds the ``stateful`` and ``data`` objects; pass neither here).
        replication: whether ``model``'s parameters and ``optimizer``'s state are the same on every rank,
            which ``CommitOptions(dedup="replicas")`` then writes in slices (docs/guides/multirank.md,
            "Replicated state written once per job"): ``"detect"`` (default): when ``model`` is a
            ``DistributedDataParallel``; ``"replicated"``: the caller says so, for a framework that trains
            the module under DDP and hands over the module inside its wrapper (the integrations do).
            Never trusted: the replicas are compared across ranks, and a job whose replicas differ
            writes whole copies with a WARNING.
        store_or_tiers: the former name of ``location``, deprecated (a ``DeprecationWarning``; goes in
            the next release).
        **flat: the flat keywords of earlier releases (``keep_last=5``, ``warmup=2``, ...), deprecated:
            each is the field of the same name of one group (:data:`asymcheck.options.FLAT_OPTIONS`)
            and warns with a ``DeprecationWarning`` that names it.

    Raises:
        UnsupportedModelError: a parameter, buffer or optimizer tensor is a
            tensor subclass other than DTensor, or a DTensor placed other
            than by ``Shard(d)`` / ``Replicate()``: nothing was hooked.
        InvalidOptionError: an option out of its range (``every=0``, ``partitioning="blocks"``,
            ``replication="ddp"``), a group not of its class, or a flat keyword beside its own group:
            nothing was hooked.
        TypeError: a keyword that is no option; ``location`` and ``store_or_tiers`` both given, or neither.
        RootLayoutError: (one process, a directory) the root's ``LAYOUT.json`` is not valid; its
            subclass RootLayoutConflictError: the root holds both layouts and no record says which
            is current. Nothing was hooked. (Under several ranks the same errors come from ``resume()``.)
        ValueError: ``across_layouts`` is not one of its modes.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, location: StoreSpec | None = None, *,
                 stateful: Mapping[str, Stateful] | None = None, data: Mapping[str, Stateful] | None = None,
                 every: int = 1, retention: RetentionOptions | None = None,
                 partitions: PartitionOptions | None = None, failures: FailureOptions | None = None,
                 preemption: PreemptionOptions | None = None, pacing: PacingOptions | None = None,
                 commits: CommitOptions | None = None, across_layouts: AcrossLayouts = "resume",
                 hooks: HooksFactory | None = None, state: StateFactory | None = None,
                 replication: Replication = "detect", store_or_tiers: StoreSpec | None = None,
                 **flat: Unpack[FlatOptions]) -> None:
        """Open the store on its own thread and register the hooks."""
        where: StoreSpec = renamed_location(location, store_or_tiers, old="store_or_tiers", caller=type(self).__name__)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidOptionError(f"every must be an int >= 1, got {every!r}")
        if replication not in REPLICATIONS:
            raise InvalidOptionError(f"replication must be one of {REPLICATIONS}, got {replication!r}")
        options = resolve({"retention": retention, "partitions": partitions, "failures": failures,
                           "preemption": preemption, "pacing": pacing, "commits": commits}, flat,
                          caller=type(self).__name__, stacklevel=3)
        if state is not None and (stateful or data):
            raise InvalidOptionError("state= builds the training state: give stateful= and data= to it, not here")
        part, fail, commit = options.partitions, options.failures, options.commits
        check_tensors(model, optimizer)
        plain = TrainingState(model, optimizer, stateful, data) if state is None else None
        self.options = options
        """The options in force (every group, defaults filled in)."""
        self.every = every
        self._pacer = Pacer(options.pacing.max_overhead)
        self.on_error = fail.on_error
        self._stats = StatsRecorder()
        self._budget = FailureBudget(self._stats, fail.on_error, fail.max_steps_without_durable,
                                     fail.max_seconds_without_durable)
        self._edits = EditTracker()
        cuda = on_cuda(model)
        clock = part.clock
        if clock is None:
            if cuda:
                from asymcheck.snapshot.cudaclock import CudaEventClock
                clock = CudaEventClock()
            else:
                clock = PerfCounterClock()
        self._planner = Planner(warmup=part.warmup, tolerance=part.replan_tolerance,
                                max_partitions=part.max_partitions, min_bytes=part.min_partition_bytes,
                                partitioning=part.partitioning)
        self._recorder = WindowRecorder(clock)
        self._pool = HostPool(commit.host_slots, pin=cuda)
        kept = options.retention
        store = open_store(where, keep_last=kept.keep_last, keep_every=kept.keep_every,
                           keep_best=kept.keep_best, across_layouts=across_layouts)
        self._loop = StoreLoop(store, name="asymcheck-store")
        try:
            built = plain if state is None else _adapter_state(state, model, optimizer, self._loop)
            assert built is not None
            enable_resharding(self._loop.store, built)  # a RankStore resumes versions of another world size
            self._commits = CommitQueue(self._loop, self._stats, max_inflight=commit.max_inflight,
                                        when_busy=commit.when_busy,
                                        first_committed=layout_recorder(where, store))
            self._engine = CopyEngine(commit.copy)
        except BaseException:
            self._loop.close()
            raise
        self._progress = Progress()
        self._cycle = VersionCycle(built, self._progress, edits=self._edits, planner=self._planner,
                                   pool=self._pool, engine=self._engine, commits=self._commits, stats=self._stats,
                                   loop=self._loop, on_recapture=self._refresh_hooks,
                                   save_on_close=options.pacing.save_on_close,
                                   replicas=slicer_for(self._loop.store, built, model, optimizer, commit.dedup,
                                                       replication, adapter=state is not None),
                                   frozen=None if state is not None or commit.frozen == "copy" else FrozenTensors(
                                       store.chunk_bytes if isinstance(store, KnownBytesStore) else None))
        self._hook_s = 0.0
        self._open_s = 0.0
        self._last_pre: float | None = None
        self._copy_mark = (0.0, 0.0)  # the copy engine's (busy, blocked) seconds at the last step record
        self.restored: RestoreInfo | None = None
        self._unusable: str | None = None  # why training must not go on (a failed in-place resume)
        self.final_versions: dict[str, list[int]] | None = None  # store.versions() when closed
        self.preempted: PreemptionRecord | None = None
        self._notice = SigtermNotice(options.preemption.preempt_on)
        self._preemption = Preemption(
            self._progress, commits=self._commits, loop=self._loop, notice=self._notice,
            agreement=agreement_for(self._loop.store),  # several ranks: one notice, one step, one boundary
            deadline_s=check_deadline(options.preemption.preempt_deadline_s), settle=self._settle,
            seal_last=self._cycle.seal_last, release=self._release, finished=self._preempted)
        self._driver = Driver(on_forward=self._on_forward, on_grad=self._on_grad, before_step=self._on_step_pre,
                              after_step=self._on_step_post, step_returned=self._on_step_returned)
        try:
            self._hooks: Hooks = (hooks or (lambda d: HookSet.driving(model, optimizer, d)))(self._driver)
        except BaseException:
            self._notice.uninstall()
            self._release(remove_hooks=False)
            raise

    # -- public ----------------------------------------------------------

    @property
    def state(self) -> TrainingState:
        """What one step's training state is, how it is captured and loaded back (the version cycle's)."""
        return self._cycle.state

    @state.setter
    def state(self, state: TrainingState) -> None:
        warnings.warn("setting Checkpointer.state is deprecated and goes in the next release: pass "
                      "Checkpointer(..., state=factory) instead", DeprecationWarning, stacklevel=2)
        self._cycle.state = state

    @property
    def driver(self) -> Driver:
        """The entry points of the snapshot protocol, for adapters that drive it from their own hooks.

        The same :class:`asymcheck.snapshot.hooks.Driver` a ``hooks=`` factory receives; a plain
        training loop never calls it (its optimizer's hooks do).
        """
        return self._driver

    @property
    def save_on_close(self) -> bool:
        """Seal the newest completed step on close if no version of it is open (the constructor's option)."""
        return self._cycle.save_on_close

    @save_on_close.setter
    def save_on_close(self, value: bool) -> None:
        self._cycle.save_on_close = value

    @property
    def preempt_deadline_s(self) -> float | None:
        """The default deadline of a preemption flush, in seconds (None: no limit)."""
        return self._preemption.deadline_s

    @preempt_deadline_s.setter
    def preempt_deadline_s(self, value: float | None) -> None:
        self._preemption.deadline_s = check_deadline(value)

    @property
    def step(self) -> int:
        """Optimizer steps completed (including those before a resume).

        With hooks that deliver a completed step late (DeepSpeed's: at the next forward) a step counts
        once delivered; code that reads it right after ``engine.step()`` calls :meth:`settle` first.
        """
        return self._progress.step

    @property
    def partitioning(self) -> Partitioning:
        """How each version's copy is spread over the next iteration (the constructor's option)."""
        return self._planner.partitioning

    @property
    def plan(self) -> Plan | None:
        """The partition plan of the newest version (None before the first step)."""
        return self._planner.current

    @property
    def store(self) -> CheckpointStore:
        """The store (runs on the Checkpointer's thread; do not call it from another loop)."""
        return self._loop.store

    def versions(self) -> dict[str, list[int]]:
        """Committed versions per tier name."""
        return self._loop.run(versions_of(self._loop.store))

    def status(self) -> dict[str, TierStatus]:
        """The store's view of each tier (versions, background lag, errors), read on the store's thread."""
        return self._loop.run(status_of(self._loop.store))

    @property
    def last_record(self) -> StepRecord | None:
        """The newest step's record (cheaper than ``stats()`` inside a training loop)."""
        return self._stats.steps[-1] if self._stats.steps else None

    @property
    def versions_dropped(self) -> int:
        """Versions dropped because a captured tensor changed before its copy (also in ``stats()``)."""
        return self._edits.dropped

    def stats(self) -> CheckpointStats:
        """Stall, copy time and bytes per step, commit counters, dropped versions, so far."""
        snap = self._stats.snapshot(self._engine.busy_seconds, self._engine.bytes_copied, self._planner.replans,
                                    self._edits.dropped, tuple(sorted(self._edits.eager)))
        return dataclasses.replace(snap, pacing=self._pacer.report(), host_bytes=self._pool.allocated_bytes)

    def resume(self) -> int | None:
        """Load the newest version that verifies into the live objects.

        Call before the first optimizer step. A damaged newest version is
        skipped in favour of the one before (see ``restored.fallbacks``).
        The model's tensors are read in place, straight from the tier (see
        :mod:`asymcheck.restore.resume`).

        Returns:
            The restored step (optimizer steps completed), or None when the
            store holds no version (a fresh start; nothing is changed).

        Raises:
            StateMismatchError: the version does not fit the model, optimizer
                or stateful objects; nothing was loaded.
            CorruptVersionError: no version verifies. The live parameters may
                hold parts of one: the next optimizer step raises
                CheckpointerStateError instead of training on them.
            CheckpointerStateError: training already started, or closed.
            StepConflictError: training already started (a step the hooks deliver late, DeepSpeed's,
                counts here too) and the store holds that step or a newer one, as at such a step
                of a plain loop.
            RootLayoutError: (several ranks) the root's ``LAYOUT.json`` is not valid, or (its subclass
                RootLayoutConflictError) the root holds both layouts and no record says which is current.
            WorldSizeMismatchError: the version was written by another number of ranks and cannot be
                resharded (see ``across_layouts`` for a single-process root).

        A job of several ranks opening a single-process root resumes its newest version, each rank
        reading its piece (see ``across_layouts`` and docs/guides/fsdp2.md); it never returns None
        beside committed versions unless ``across_layouts="start_fresh"`` says so.
        """
        self._require_open()
        self._settle()  # DeepSpeed: an engine step not delivered yet (no forward since) counts as a step here
        if self._progress.started:
            raise CheckpointerStateError("resume() must be called before the first optimizer step")
        self._forget_frozen("resume")
        try:
            ckpt, in_place = restore_exchanged(self._loop.run, self._loop.store, self.state)  # slices: exchanged
        except NoCheckpointError:
            logger.info("no checkpoint in the store: starting fresh")
            self._cycle.checked_store = True
            return None
        except CorruptVersionError as exc:
            self._unusable = f"resume() found no version that verifies and the live model may hold parts of one: {exc}"
            raise
        try:
            self.state.load(ckpt.tensors, ckpt.meta)
        except BaseException as exc:
            if in_place:
                self._unusable = f"resume() failed after reading into the live model: {exc!r}"
            elif self.state.touched:  # past its checks: the live objects may hold parts of the version
                self._unusable = f"resume() failed while loading the version into the live objects: {exc!r}"
            raise
        self._progress.step = self._progress.saved_step = ckpt.step
        self._budget.restart(ckpt.step)
        self._cycle.checked_store = True
        self.restored = RestoreInfo(ckpt.step, ckpt.tier, tuple(ckpt.fallbacks))
        logger.info("resumed step %d from %s%s", ckpt.step, ckpt.tier,
                    f" after {len(ckpt.fallbacks)} fallback(s)" if ckpt.fallbacks else "")
        return ckpt.step

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        """Record metrics of the newest completed step (an evaluation): its version carries them.

        They go into the version's meta as ``meta["metrics"]``, where ``keep_best``
        (:class:`asymstore.KeepBest`) reads them. Call it after the optimizer step
        the metrics belong to and before the next one; metrics of a step whose
        version is not taken (``every`` > 1, pacing) are dropped.

        Under hooks that deliver a step late (DeepSpeed: at the next forward) the step is delivered
        first (:meth:`settle`; so call it from the training thread), so metrics logged right after
        ``engine.step()`` go with its version.

        Raises:
            InvalidMetaError: a name is not a string or a value not a finite number.
        """
        self.settle()  # DeepSpeed: without it the metrics went to the step before, whose version was sealed (lost)
        clean: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value):
                raise InvalidMetaError(f"metric {name!r}: a name and a finite number are needed, got {value!r}")
            clean[name] = float(value)
        self._cycle.metrics.setdefault(self._progress.step, {}).update(clean)

    def mark(self) -> None:
        """Say that the loop body of this iteration is done: the open version takes its small state now.

        Needed only in loops the hooks cannot read: ones that, after
        ``optimizer.step()`` and within the same iteration, draw from the
        global RNG or a ``data`` object, run a forward in training mode (dropout
        RNG, BatchNorm statistics), or run a forward with grad enabled before
        ``scheduler.step()``. Call it as the last statement of the loop body:
        buffers, RNG states, ``data`` and ``stateful`` objects and param groups
        of the open version are taken again here (parameters and optimizer
        tensors keep their values of the step). A no-op when no version is open.
        """
        self._settle()
        snap = self._cycle.snap
        if self._progress.closed or snap is None:
            return
        fresh = self.state.capture_step(self.state.capture_moment())
        taken = set(self._edits.eager) | set(snap.capture.known)  # copied eagerly, or known unchanged
        if [n for n in fresh.names if n not in taken] == snap.capture.names:
            snap.capture.eager.update(fresh.eager)  # eagerly copied edited tensors keep their values of the step
            snap.capture.meta = fresh.meta
            self.state.capture_next(snap.capture)
            snap.next_pending = False
        elif snap.next_pending:  # parameters added since the step: re-capture (nothing was copied yet)
            Moment.of(fresh).apply(snap.capture)
            self._cycle.snap = self._cycle.capture_next(snap)

    @contextlib.contextmanager
    def editing(self) -> Iterator[None]:
        """Run code that edits captured tensors between steps without losing the version.

        The pending version's copy is finished first (a stall of what was
        left to copy), so the block may change parameters or optimizer state
        freely: the version keeps the values of the step. For EMA evaluation
        (``with ckpt.editing(), ema.average_parameters(): evaluate(model)``),
        weight surgery, ``load_state_dict`` or ``p.data`` edits between steps.
        Edits outside it, before the lazy copy read them, are detected and the
        version is dropped (see :mod:`asymcheck.snapshot.edits`).
        """
        self._settle()
        snap = self._cycle.snap
        if snap is not None and not self._progress.closed and not snap.verified:
            started = time.perf_counter()
            self._cycle.finish_copy(snap)
            self._hook_s += time.perf_counter() - started
        try:
            yield
        finally:  # the block may have edited frozen parameters in ways their version counter misses
            self._forget_frozen("editing()")

    def _forget_frozen(self, reason: str) -> None:
        """The next version copies every frozen parameter again (see :mod:`asymcheck.snapshot.frozen`)."""
        if self._cycle.frozen is not None:
            self._cycle.frozen.forget(reason)

    def settle(self) -> None:
        """Deliver an optimizer step whose hooks report its completion late: :attr:`step` counts it, its version opens.

        The DeepSpeed adapter's hooks deliver a completed ``engine.step()`` at the next forward (or at
        :meth:`mark`), so between the engine's step and that forward :attr:`step` is one behind. An
        integration that reads :attr:`step` there (Lightning's ``on_train_batch_end``) calls this first.
        A no-op when nothing is pending (a plain optimizer's hooks deliver the step when it returns)
        and once closed.
        """
        if not self._progress.closed:
            self._settle()

    def flush(self) -> None:
        """Wait until every sealed version is committed (and apply the failure policy)."""
        self._commits.drain()
        self._budget.check(self._progress.step, self._commits.take_error())

    def close(self) -> None:
        """Capture the last step (if not saved), commit it, wait for every commit, release everything.

        Raises:
            CommitFailedError: the final version was not committed (unless ``on_error="log"``).
        """
        self._close(save=True)

    def preempt(self, deadline_s: float | None = None) -> PreemptionRecord:
        """Finish now: commit the newest completed step durably within a deadline, then close (no exit).

        For schedulers that announce preemption other than by SIGTERM; call it
        from the training thread between iterations. Waits for the commits in
        flight, seals and commits the newest completed step, and waits until a
        persistent tier holds it (under several ranks: the global version),
        never past the deadline; ``ckpt.preempted`` tells what it managed.
        SIGTERM does the same at the next hook, then lets the process exit.

        Under several ranks it is collective: every rank calls it after the same
        optimizer step. It also publishes the notice (see :mod:`asymcheck.policy.agreement`),
        so that a rank that did not call it flushes the same step at its next hook
        (and does not exit).

        Args:
            deadline_s: seconds it may take (default: ``preempt_deadline_s``; ``math.inf``: no limit).
        """
        self._require_open()
        return self._preemption.explicit(deadline_s)

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

    def _settle(self) -> None:
        """Open a version whose step finished but was not delivered yet (hooks that deliver it late)."""
        self._hooks.settle()

    def _on_forward(self, training: bool) -> None:
        if training:  # a validation forward (no_grad or eval()) is not part of the next iteration
            self._event(FORWARD)

    def _on_grad(self) -> None:
        self._preemption.joined = True  # gradients started: their collectives may complete on the other ranks
        self._event(BACKWARD)

    def _event(self, phase: str) -> None:
        self._preemption.check()
        if self._progress.closed:
            return
        started = time.perf_counter()
        ordinal = self._recorder.enter(phase)
        snap = self._cycle.snap
        if snap is not None:
            if snap.next_pending:
                snap = self._cycle.snap = self._cycle.capture_next(snap)
            if not snap.verified:
                snap.issue_event(ordinal, self._engine, phase)
        self._recorder.leave()
        self._hook_s += time.perf_counter() - started

    def _on_step_pre(self) -> None:
        if self._unusable is not None:
            raise CheckpointerStateError(self._unusable + "; rebuild the model and optimizer (or start fresh)")
        self._preemption.joined = True
        self._preemption.check()
        if self._progress.closed:
            return
        started = time.perf_counter()
        for windows in self._recorder.finish():
            self._planner.observe(windows)
        self._budget.check(self._progress.step, self._commits.take_error())
        self._progress.in_step = True
        snap, self._cycle.snap = self._cycle.snap, None
        sealed = skipped = dropped = False
        waited = 0.0
        nbytes = 0
        by_phase: Mapping[str, int] = {}
        if snap is not None:
            done = self._cycle.seal(snap)
            waited, nbytes, dropped, by_phase = done.waited, done.nbytes, done.dropped, done.by_phase
            sealed, skipped = not dropped, not done.submitted and not dropped
        ended = time.perf_counter()
        iteration = started - self._last_pre if self._last_pre is not None else 0.0
        self._last_pre = started
        self._pacer.iteration(iteration)
        busy, blocked = self._engine.busy_seconds, self._engine.blocked_seconds
        copy_s = busy - self._copy_mark[0]
        self._stats.add_step(StepRecord(
            step=self._progress.step, sealed=sealed, stall_s=ended - started, backpressure_s=waited,
            hook_s=self._hook_s, open_s=self._open_s, copy_bytes=nbytes, iteration_s=iteration, skipped=skipped,
            copy_s=copy_s, dropped=dropped, overlap_s=max(0.0, copy_s - (blocked - self._copy_mark[1])),
            forward_bytes=by_phase.get(FORWARD, 0), backward_bytes=by_phase.get(BACKWARD, 0),
            boundary_bytes=by_phase.get(DRAIN, 0)))
        self._copy_mark = (busy, blocked)
        self._hook_s = self._open_s = 0.0

    def _on_step_returned(self) -> None:
        if not self._progress.closed and (self._progress.step + 1) % self.every == 0:
            self._cycle.moment = self.state.capture_moment()  # before the next batch is drawn

    def _on_step_post(self) -> None:
        if self._progress.closed:
            return
        started = time.perf_counter()
        self._progress.in_step = False
        self._progress.started = True
        self._progress.step += 1
        self._preemption.boundary = True  # the next training hook is an iteration boundary
        self._preemption.joined = False
        self._hooks.refresh()
        if self._progress.step % self.every == 0 and self._pacer.take(self._progress.step):
            self._cycle.open(self._progress.step)
        self._recorder.start()
        self._open_s = time.perf_counter() - started
        # no notice check here: the loop's own scheduler.step() etc. of this step have not run yet

    def _refresh_hooks(self) -> None:
        """Follow parameters added since the hooks were registered."""
        self._hooks.refresh()

    def _preempted(self, record: PreemptionRecord) -> None:
        """Keep what a preemption flush recorded (``preempted``, ``final_versions``)."""
        self.final_versions = dict(record.versions)
        self.preempted = record

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

    def _require_open(self) -> None:
        if self._progress.closed:
            raise CheckpointerStateError("the Checkpointer is closed")

    def _close(self, *, save: bool, remove_hooks: bool = True) -> None:
        if not self._progress.closed:
            self._hooks.settle()  # a step delivered late opens its version before close() seals it
        if self._progress.closed:
            if remove_hooks:
                self._hooks.remove()  # left registered by a preemption flush inside a hook
                self._notice.uninstall()
            return
        self._progress.closed = True
        try:
            self._cycle.seal_last(save)
            self._commits.drain()
            self.final_versions = self._loop.run(versions_of(self._loop.store))
        finally:
            self._release(remove_hooks=remove_hooks)
        error = self._commits.take_error()
        if self.on_error == "raise" and error is not None:
            self._budget.check(self._progress.step, error)
        self._budget.check_final()
