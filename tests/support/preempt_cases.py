"""What one rank does in a preemption case of the multi-rank tests (run by tests/support/mr_cases.py's ``run``).

A case with ``"preempt": {"at": K, "deadline_s": D}`` trains like the ``attach`` mode of its ``kind``
(the same model, optimizer, scheduler, data, ``stateful`` objects and checkpoint settings, so that
the ``attach`` mode resumes from what it left) and, in iteration ``K``, every rank sends itself
SIGTERM from inside the training step:

- ``"ddp"`` (DDP + Checkpointer over a RankStore; with ``peer``, ``ordered`` and ``kill: commit:N`` as in
  tests/support/mr_cases.py,
  over [memory, peer, disk]): from a forward pre-hook of the middle of the
  model, in the forward pass of iteration K. The program has its own SIGTERM handler, installed
  before the Checkpointer: the Checkpointer chains to it after its flush, and it writes
  ``ckpt.preempted`` as a ``preempted`` event, then dies by SIGTERM's default action.
- ``"ds"`` (DeepSpeed ``attach()``): from the inner optimizer's step post-hook, inside
  ``engine.step()`` of iteration K (ZeRO has not copied the new masters into the parameters yet).
  SIGTERM keeps its default action: the Checkpointer hands it on and the process ends killed by it.

With ``"spread_ms": S`` (and ``"seed"``) instead, nothing is sent from inside the step: when iteration
``K`` begins (a forward pre-hook of the outermost module), each rank starts a timer that SIGTERMs it
after its own random delay in [0, S) ms (seeded per rank), as a scheduler's signals reach the ranks of
a job a few milliseconds apart (with ``"ranks": [...]``, only those ranks are signalled); the ranks
agree on one step through the key-value store (asymcheck/policy/agreement.py). A logging handler on
``asymcheck.policy.preempt`` writes every rank's ``PreemptionRecord`` as a ``record`` event before the
signal is handed on.

Either way the process must never reach the end of training (a ``finished`` event says it did).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import threading
from types import FrameType
from typing import Any

import torch
from torch import nn

from tests.support.mr_cases import (
    TIMEOUT,
    DataPosition,
    Log,
    batch,
    ds_engine,
    ds_train,
    make_model,
    ordered_mean,
    peer_tiers,
    rank_tiers,
)


def sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class RecordWriter(logging.Handler):
    """Writes the PreemptionRecord the Checkpointer logs (``extra={"preemption": record}``) as an event."""

    def __init__(self, log: Log) -> None:
        super().__init__(logging.WARNING)
        self.out = log

    def emit(self, record: logging.LogRecord) -> None:
        found = getattr(record, "preemption", None)
        if found is not None:
            self.out.event(event="record", record=dataclasses.asdict(found))


def spread_trigger(case: dict[str, Any], rank: int, log: Log, iteration: Any) -> Any:
    """A forward pre-hook that, once iteration ``at`` begins, SIGTERMs this rank after its random delay."""
    spec = case["preempt"]
    delay = random.Random(spec["seed"] * 1000 + rank).uniform(0.0, spec["spread_ms"] / 1000.0)
    started: list[bool] = []

    def hook(module: Any, args: Any) -> None:
        if iteration() == spec["at"] and not started and module.training:
            started.append(True)
            if rank in spec.get("ranks", [rank]):  # "ranks": only these get a SIGTERM (the others, the notice)
                log.event(event="timer", delay_s=delay)
                threading.Timer(delay, sigterm_self).start()

    return hook


def run_preempt(case: dict[str, Any], rank: int, log: Log) -> None:
    """Train ``case`` with checkpoints until every rank's SIGTERM of iteration ``preempt.at`` ends it."""
    logger = logging.getLogger("asymcheck.policy.preempt")
    logger.addHandler(RecordWriter(log))
    logger.addHandler(logging.StreamHandler())  # its lines stay in the driver's log (no last-resort handler now)
    if case["kind"] == "ds":
        preempt_ds(case, rank, log)
    else:
        preempt_ddp(case, rank, log)
    log.event(event="finished")  # not reached: SIGTERM ends the process


def preempt_ddp(case: dict[str, Any], rank: int, log: Log) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from asymcheck import Checkpointer
    from asymcheck.options import PartitionOptions, PreemptionOptions
    from asymstore.multirank import RankStore

    dist.init_process_group("gloo", timeout=TIMEOUT)
    n, at = case["iterations"], case["preempt"]["at"]
    model = DDP(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    pos = DataPosition()
    ckpt: Any = None

    def own_handler(signum: int, frame: FrameType | None) -> None:  # chained to by the Checkpointer
        record = ckpt.preempted if ckpt is not None else None
        log.event(event="preempted", record=dataclasses.asdict(record) if record is not None else None)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sigterm_self()

    if case.get("ordered"):
        model.register_comm_hook(None, lambda state, bucket: ordered_mean(state, bucket))
    where: Any = case["dir"]
    if case.get("peer"):  # [memory (durable), peer, disk]: the flush waits for the disk
        tiers = peer_tiers(case, rank)
        where = RankStore(case["dir"], tiers=tiers, durable=tiers[0].name, keep_last=3, timeout_s=60.0)
    elif rank_tiers(case, rank) is not None:  # "kill": {"rank": r, "at": "commit:N"}: r dies in its commit N + 1
        where = RankStore(case["dir"], tiers=rank_tiers(case, rank), keep_last=3, timeout_s=60.0)
    signal.signal(signal.SIGTERM, own_handler)
    ckpt = Checkpointer(model, opt, where, stateful={"sched": sched, "pos": pos},
                        partitions=PartitionOptions(warmup=1, min_partition_bytes=512),
                        preemption=PreemptionOptions(preempt_deadline_s=case["preempt"].get("deadline_s", 25.0)))
    assert isinstance(ckpt.store, RankStore)
    log.event(event="resumed", step=ckpt.resume(), iteration=pos.iteration)
    if "spread_ms" in case["preempt"]:
        model.register_forward_pre_hook(spread_trigger(case, rank, log, lambda: pos.iteration))
    else:
        model.module[4].register_forward_pre_hook(lambda m, a: sigterm_self() if pos.iteration == at else None)
    for it in range(pos.iteration, n):  # the loop of mr_cases.run_ddp
        x, y = batch(it, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log.loss(it, loss.item())
        pos.iteration += 1
    ckpt.close()


def preempt_ds(case: dict[str, Any], rank: int, log: Log) -> None:
    import deepspeed

    import asymcheck.deepspeed as ads
    from asymcheck.deepspeed.hooks import inner_optimizer
    from asymcheck.options import PartitionOptions, PreemptionOptions, RetentionOptions

    deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    n, at = case["iterations"], case["preempt"]["at"]
    engine = ds_engine(case["stage"])
    pos = DataPosition()
    ckpt = ads.attach(engine, case["dir"], root=case["dir"], stateful={"pos": pos}, timeout_s=60.0,
                      retention=RetentionOptions(keep_last=3),
                      partitions=PartitionOptions(warmup=1, min_partition_bytes=512),
                      preemption=PreemptionOptions(preempt_deadline_s=case["preempt"].get("deadline_s", 25.0)))
    log.event(event="resumed", step=ckpt.resume(), iteration=pos.iteration)
    if "spread_ms" in case["preempt"]:
        engine.module.register_forward_pre_hook(spread_trigger(case, rank, log, lambda: pos.iteration))
    else:
        inner_optimizer(engine).register_step_post_hook(
            lambda opt, args, kwargs: sigterm_self() if pos.iteration == at else None)
    ds_train(engine, pos.iteration, n, rank, log, pos)
    ckpt.close()
