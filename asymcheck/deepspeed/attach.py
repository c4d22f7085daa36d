"""attach(): per-iteration asymmetric snapshots of a DeepSpeed engine (ZeRO 0-3) into a multi-rank store.

Guide: docs/guides/deepspeed.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

from asymcheck.checkpointer import Checkpointer, StoreRunner
from asymcheck.deepspeed.hooks import DeepSpeedHooks, inner_optimizer
from asymcheck.deepspeed.state import DeepSpeedState
from asymcheck.deepspeed.support import check_engine
from asymcheck.deepspeed.types import register_deepspeed_types
from asymcheck.options import GROUPS, CheckpointerOptions, renamed_location, resolve
from asymcheck.snapshot.hooks import Driver
from asymcheck.state.replicas import Replication
from asymcheck.state.trainstate import Stateful
from asymstore.errors import AsymstoreError, WorldSizeMismatchError
from asymstore.format.pieces import TensorLayout
from asymstore.multirank import RankStore
from asymstore.opener import open_store
from asymstore.protocols import CheckpointStore, CollectiveStore, ReshardingStore
from asymstore.tiers.protocol import Tier
from asymstore.values import Targets

logger = logging.getLogger(__name__)

StoreSpec = CollectiveStore | str | os.PathLike[str] | Sequence[Tier]


class DeepSpeedCheckpointer(Checkpointer):
    """A :class:`asymcheck.Checkpointer` driven by a DeepSpeed engine; made by :func:`attach`.

    Versions are numbered by optimizer steps completed and hold, per rank,
    what ``save_checkpoint`` would write (see :mod:`asymcheck.deepspeed.state`),
    copied during the forward and backward passes of the next iteration.
    Every rank commits its shard; rank 0 publishes the global version once all
    did. ``resume()`` is collective and loads through ``engine.load_checkpoint``.
    It drives the Checkpointer through its public ``hooks=`` and ``state=`` parameters
    (:class:`asymcheck.deepspeed.hooks.DeepSpeedHooks`, :class:`asymcheck.deepspeed.state.DeepSpeedState`).
    """

    def __init__(self, engine: Any, store: CollectiveStore, *, stateful: Mapping[str, Stateful] | None = None,
                 data: Mapping[str, Stateful] | None = None, every: int = 1,
                 **options: Unpack[CheckpointerOptions]) -> None:
        """Hook ``engine``; see :func:`attach` for the arguments."""
        check_engine(engine, "attach")
        register_deepspeed_types()
        self.engine = engine

        def state(opened: CheckpointStore, run: StoreRunner) -> DeepSpeedState:
            return DeepSpeedState(engine, store, run, stateful, data)

        def hooks(driver: Driver) -> DeepSpeedHooks:
            return DeepSpeedHooks(engine, on_forward=driver.on_forward, on_grad=driver.on_grad,
                                  on_step_pre=driver.before_step, on_step_post=driver.after_step,
                                  on_step_done=driver.step_returned)

        # below ZeRO-3 the module's parameters are the same on every rank: written in slices (the state says which)
        replication: Replication = "detect" if engine.zero_optimization_partition_weights() else "replicated"
        super().__init__(engine.module, inner_optimizer(engine), store, every=every, hooks=hooks, state=state,
                         replication=replication, **options)
        if isinstance(store, ReshardingStore):  # ZeRO partitions carry no layout: another world size stays
            store.reshard = None  # WorldSizeMismatchError

    def resume(self) -> int | None:
        """Load the newest global version through ``engine.load_checkpoint`` (collective); see the Checkpointer's.

        A version holding slices of the replicated model states file is read slice by slice from every
        rank's shard; a version of another number of ranks is refused (``WorldSizeMismatchError``), sliced
        or not.
        """
        store = self.store
        if not isinstance(store, RankStore):
            return super().resume()
        store.reshard = _whole_slices(store.world_size) if _newest_same_world(store) else None
        try:
            return super().resume()
        finally:
            store.reshard = None

    @property
    def rank_store(self) -> CollectiveStore:
        """The multi-rank store."""
        store = self.store
        assert isinstance(store, CollectiveStore)  # attach() only makes this adapter over one
        return store


def _newest_same_world(store: RankStore) -> bool:
    """Whether the newest readable global version of ``store`` was written by its number of ranks.

    Then (only) the restore may read slices; else it refuses as before (``WorldSizeMismatchError``).
    """
    for step in reversed(store.global_steps()):
        try:
            return store.read_global(step).world_size == store.world_size
        except (AsymstoreError, OSError):  # the restore skips an unreadable one as well
            continue
    return False


def _whole_slices(world: int) -> Targets:
    """Targets of a restore: every slice of the replicated state is read whole (the same number of ranks only)."""

    def targets(old: Mapping[str, TensorLayout]) -> dict[str, TensorLayout]:
        out: dict[str, TensorLayout] = {}
        for name, lay in old.items():
            if lay.mesh is None or lay.mesh.shape != (world,) or lay.placements != ("S(0)",):
                raise WorldSizeMismatchError(
                    f"{name} was written as a slice over {lay.mesh.shape if lay.mesh else 'no'} rank(s) in a job of "
                    f"{world}: a DeepSpeed version is restored on the number of ranks that wrote it")
            out[name] = TensorLayout.whole(lay.global_shape, lay.dtype)
        return out

    return targets


def attach(engine: Any, location: StoreSpec | None = None, every: int = 1, *,
           root: str | os.PathLike[str] | None = None, stateful: Mapping[str, Stateful] | None = None,
           data: Mapping[str, Stateful] | None = None, timeout_s: float = 300.0,
           store_or_tiers: StoreSpec | None = None, **options: Unpack[CheckpointerOptions]) -> DeepSpeedCheckpointer:
    """Snapshot ``engine`` every ``every`` optimizer steps, asymmetrically, into a multi-rank store.

    ::

        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        ckpt = asymcheck.deepspeed.attach(engine, "ckpt")      # every rank
        start = ckpt.resume() or 0                             # collective; optimizer steps done
        for step in range(start, total):
            engine.backward(engine(batch(step)))
            engine.step()
        ckpt.close()                                           # commits the last step

    Args:
        engine: the engine ``deepspeed.initialize`` returned (ZeRO stage 0, 1, 2 or 3).
        location: where the checkpoint lives: a directory (the multi-rank root: ``rank-NNNNN/``
            per rank and ``global/``), an unopened :class:`asymstore.multirank.RankStore`, or this
            rank's tiers (fastest first) with ``root=`` for the global manifests.
        every: snapshot every ``every``-th optimizer step.
        root: the multi-rank root when ``location`` is a list of tiers.
        stateful: name -> object with ``state_dict``/``load_state_dict`` updated after the step
            (counters advanced at the end of the loop body, your own schedulers), saved per rank.
        data: name -> object with ``state_dict``/``load_state_dict`` that advances when a batch is drawn
            (data loader, sampler): taken when the optimizer step returns, saved per rank.
        timeout_s: how long rank 0 waits for every rank's shard at each commit.
        store_or_tiers: the former name of ``location``, deprecated (a ``DeprecationWarning``; goes in
            the next release).
        **options: the Checkpointer's typed option groups (:class:`asymcheck.options.CheckpointerOptions`:
            ``retention=RetentionOptions(keep_last=5)``, ``partitions=PartitionOptions(...)``,
            ``preemption=...``, ...). ``retention`` applies to the global versions of the store built
            here (a store passed in keeps its own rules). Keep ``CommitOptions(when_busy="wait")``: a
            version one rank skips can never be completed globally. SIGTERM is handled as by the
            Checkpointer: the ranks agree through the key-value store on one step (the one after the
            step in flight), every rank trains to it and commits it at the same iteration boundary,
            the global commit completes, then the signal is handed on (see
            :mod:`asymcheck.policy.agreement`). The flat keywords of earlier releases
            (``keep_last=3``, ``partitioning="uniform"``) still work, with a ``DeprecationWarning``.

    Raises:
        UnsupportedConfigError: the engine uses a setting whose state the capture would miss
            (offload, MoE, pipeline or model parallelism, ZeRO++ hpZ; see
            :mod:`asymcheck.deepspeed.support`) or an untested DeepSpeed version.
        InvalidOptionError: a Checkpointer option out of its range (``partitioning="blocks"``), or a
            flat keyword beside its own group.
        TypeError: a keyword that is no option.
    """
    where: StoreSpec = renamed_location(location, store_or_tiers, old="store_or_tiers", caller="attach")
    check_engine(engine, "attach")
    flat: dict[str, Any] = dict(options)
    groups = {name: flat.pop(name, None) for name in GROUPS}
    across = flat.pop("across_layouts", None)
    resolved = resolve(groups, flat, caller="attach", stacklevel=3)
    keep_last, keep_every, keep_best = (resolved.retention.keep_last, resolved.retention.keep_every,
                                        resolved.retention.keep_best)
    if isinstance(where, CollectiveStore):
        store = where
    else:  # a RankStore whatever the world size: a directory, or this rank's tiers with root=
        if root is None and not isinstance(where, (str, os.PathLike)):
            raise ValueError("attach() with a list of tiers needs root= (the directory of the global manifests)")
        opened = open_store(where, root=root, multirank=True, keep_last=keep_last, keep_every=keep_every,
                            keep_best=keep_best, timeout_s=timeout_s)
        assert isinstance(opened, CollectiveStore)
        store = opened
    forwarded: CheckpointerOptions = {
        "retention": resolved.retention, "partitions": resolved.partitions, "failures": resolved.failures,
        "preemption": resolved.preemption, "pacing": resolved.pacing, "commits": resolved.commits}
    if across is not None:
        forwarded["across_layouts"] = across
    return DeepSpeedCheckpointer(engine, store, stateful=stateful, data=data, every=every, **forwarded)
