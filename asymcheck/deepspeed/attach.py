"""attach(): per-iteration asymmetric snapshots of a DeepSpeed engine (ZeRO 0-3) into a multi-rank store."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from asymcheck.checkpointer import Checkpointer
from asymcheck.deepspeed.hooks import DeepSpeedHooks, inner_optimizer
from asymcheck.deepspeed.state import DeepSpeedState
from asymcheck.deepspeed.support import check_engine
from asymcheck.deepspeed.types import register_deepspeed_types
from asymcheck.state.trainstate import Stateful
from asymstore import KeepBest
from asymstore.api import CollectiveStore, ReshardingStore
from asymstore.opener import open_store
from asymstore.tiers.protocol import Tier

logger = logging.getLogger(__name__)

StoreSpec = CollectiveStore | str | os.PathLike[str] | Sequence[Tier]


class DeepSpeedCheckpointer(Checkpointer):
    """A :class:`asymcheck.Checkpointer` driven by a DeepSpeed engine; made by :func:`attach`.

    Versions are numbered by optimizer steps completed and hold, per rank,
    what ``save_checkpoint`` would write (see :mod:`asymcheck.deepspeed.state`),
    copied during the forward and backward passes of the next iteration.
    Every rank commits its shard; rank 0 publishes the global version once all
    did. ``resume()`` is collective and loads through ``engine.load_checkpoint``.
    """

    def __init__(self, engine: Any, store: CollectiveStore, *, stateful: Mapping[str, Stateful] | None = None,
                 data: Mapping[str, Stateful] | None = None, every: int = 1, **kwargs: Any) -> None:
        """Hook ``engine``; see :func:`attach` for the arguments."""
        check_engine(engine, "attach")
        register_deepspeed_types()
        super().__init__(engine.module, inner_optimizer(engine), store, stateful=stateful, data=data, every=every,
                         **kwargs)
        self._hooks.remove()  # the plain adapter's optimizer hooks do not fit DeepSpeed's step
        if isinstance(store, ReshardingStore):  # ZeRO partitions carry no layout: another world size stays
            store.reshard = None  # WorldSizeMismatchError
        self.engine = engine
        self.state = DeepSpeedState(engine, store, self._loop.run, stateful, data)
        self._hooks = self._ds_hooks = DeepSpeedHooks(
            engine, on_forward=self._on_forward, on_grad=self._on_grad, on_step_pre=self._on_step_pre,
            on_step_post=self._on_step_post, on_step_done=self._on_step_done)

    def _on_step_done(self) -> None:
        if not self._progress.closed and (self._progress.step + 1) % self.every == 0:
            self._cycle.moment = self.state.capture_moment()  # before the next batch is drawn

    def _settle(self) -> None:
        self._ds_hooks.settle()

    @property
    def rank_store(self) -> CollectiveStore:
        """The multi-rank store."""
        store = self.store
        assert isinstance(store, CollectiveStore)  # attach() only makes this adapter over one
        return store

    def _close(self, *, save: bool, remove_hooks: bool = True) -> None:
        if not self._progress.closed:
            self._ds_hooks.settle()  # the last step's version opens before close() seals it
        super()._close(save=save, remove_hooks=remove_hooks)


def attach(engine: Any, store_or_tiers: StoreSpec, every: int = 1, *, root: str | os.PathLike[str] | None = None,
           stateful: Mapping[str, Stateful] | None = None, data: Mapping[str, Stateful] | None = None,
           keep_last: int | None = 3, keep_every: int | None = None, keep_best: KeepBest | None = None,
           timeout_s: float = 300.0, **kwargs: Any) -> DeepSpeedCheckpointer:
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
        store_or_tiers: a directory (the multi-rank root: ``rank-NNNNN/`` per rank and
            ``global/``), an unopened :class:`asymstore.multirank.RankStore`, or this
            rank's tiers (fastest first) with ``root=`` for the global manifests.
        every: snapshot every ``every``-th optimizer step.
        root: the multi-rank root when ``store_or_tiers`` is a list of tiers.
        stateful: name -> object with ``state_dict``/``load_state_dict`` updated after the step
            (counters advanced at the end of the loop body, your own schedulers), saved per rank.
        data: name -> object with ``state_dict``/``load_state_dict`` that advances when a batch is drawn
            (data loader, sampler): taken when the optimizer step returns, saved per rank.
        keep_last: global versions kept (when the store is built here).
        keep_every: also keep every global version whose step is a multiple of it (when the store
            is built here).
        keep_best: also keep the best global versions by a metric given to ``log_metrics`` (when
            the store is built here).
        timeout_s: how long rank 0 waits for every rank's shard at each commit.
        **kwargs: passed to :class:`asymcheck.Checkpointer` (``partitioning``, ``warmup``, ``max_inflight``,
            ``host_slots``, ``min_partition_bytes``, ``preempt_on``, ``preempt_deadline_s``...).
            Keep ``when_busy="wait"``: a version one rank skips can never be completed globally.
            SIGTERM is handled as by the Checkpointer: the ranks agree through the key-value store
            on one step (the one after the step in flight), every rank trains to it and commits it
            at the same iteration boundary, the global commit completes, then the signal is handed
            on (see :mod:`asymcheck.policy.agreement`).

    Raises:
        UnsupportedConfigError: the engine uses a setting whose state the capture would miss
            (offload, MoE, pipeline or model parallelism, ZeRO++ hpZ; see
            :mod:`asymcheck.deepspeed.support`) or an untested DeepSpeed version.
        InvalidOptionError: a Checkpointer option out of its range (``partitioning="blocks"``).
    """
    check_engine(engine, "attach")
    if isinstance(store_or_tiers, CollectiveStore):
        store = store_or_tiers
    else:  # a RankStore whatever the world size: a directory, or this rank's tiers with root=
        if root is None and not isinstance(store_or_tiers, (str, os.PathLike)):
            raise ValueError("attach() with a list of tiers needs root= (the directory of the global manifests)")
        opened = open_store(store_or_tiers, root=root, multirank=True, keep_last=keep_last, keep_every=keep_every,
                            keep_best=keep_best, timeout_s=timeout_s)
        assert isinstance(opened, CollectiveStore)
        store = opened
    return DeepSpeedCheckpointer(engine, store, stateful=stateful, data=data, every=every, **kwargs)
