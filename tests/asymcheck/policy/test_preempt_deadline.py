"""``Checkpointer.preempt(deadline_s)`` in one process: the persistent-tier wait, and a deadline that expires.

The stores are real: a host-memory tier as the durable tier with a local disk
behind it (the background cascade copies each version there), or a local disk
alone. The only fakes are :class:`asymstore.testing.SlowLocalTier` and :class:`GatedLocalTier`, real
``LocalTier`` s that stall their commits to inject a slow disk (the gated one until the test lets it go,
so the deadline tests check order and outcome, not a wall-clock bound).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import torch
from torch import nn

from asymcheck import Checkpointer
from asymcheck.options import PartitionOptions, PreemptionOptions
from asymstore import AsymStore, LocalTier, host_tier
from asymstore.testing import SlowLocalTier
from asymstore.tiers.local import _DirWriter

FAST = {"segment_bytes": 1 << 20, "compression": "never"}  # nothing to calibrate


class GatedLocalTier(LocalTier):
    """A LocalTier whose commits after the first ``after`` stall before their manifest until ``gate`` is set.

    The deadline tests open the gate only once ``preempt()`` returned: a flush that waited for such a
    commit instead of its deadline would return only after ``GATE_S`` (30 s) with the version durable, which
    they refuse. Order and outcome, never a wall-clock bound.
    """

    GATE_S = 30.0

    def __init__(self, root: Path, *, after: int) -> None:
        super().__init__(root)
        self.after = after
        self.commits = 0
        self.gate = threading.Event()

    async def begin(self, step: int, nbytes: int) -> _DirWriter:
        writer = await super().begin(step, nbytes)
        return _GatedWriter(self, step, writer.tmp)


class _GatedWriter(_DirWriter):
    tier: GatedLocalTier

    def _publish_sync(self, manifest: bytes, latest: bool = False) -> bool:
        self.tier.commits += 1
        if self.tier.commits > self.tier.after:
            self.tier.gate.wait(self.tier.GATE_S)
        return super()._publish_sync(manifest, latest)


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for it in range(steps):
        g = torch.Generator().manual_seed(it)
        loss = nn.functional.mse_loss(model(torch.randn(4, 32, generator=g)), torch.randn(4, 8, generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def on_disk(root: Path) -> list[int]:
    async def read() -> list[int]:
        async with AsymStore([LocalTier(root)], read_only=True) as store:
            return store.versions()[LocalTier(root).name]

    return asyncio.run(read())


def restored_step_and_weight(root: Path) -> tuple[int, torch.Tensor]:
    async def read() -> tuple[int, torch.Tensor]:
        async with AsymStore([LocalTier(root)], read_only=True) as store:
            ckpt = await store.restore()
            [name] = [k for k in ckpt.tensors if k.endswith("0.weight")]
            return ckpt.step, ckpt.tensors[name]

    return asyncio.run(read())


def wait_until(cond: object, timeout: float = 30.0) -> bool:
    assert callable(cond)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_preempt_waits_for_the_persistent_copy_behind_a_memory_durable_tier(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    host, slow = host_tier(64 << 20), SlowLocalTier(disk, delay_s=0.3)
    store = AsymStore([host, slow], durable=host, **FAST)
    model, opt = make()
    ckpt = Checkpointer(model, opt, store, preemption=PreemptionOptions(preempt_on="none"),
                        partitions=PartitionOptions(warmup=1, min_partition_bytes=512))
    train(model, opt, 5)
    record = ckpt.preempt(deadline_s=20.0)
    assert record.reason == "explicit" and record.step == 5
    assert not record.deadline_hit and record.error is None
    assert record.persistent_step == 5 and record.durable  # waited for the background copy to the disk
    assert record.global_step is None  # one process, no global versions
    assert 5 in record.versions[host.name] and 5 in record.versions[slow.name]
    step, weight = restored_step_and_weight(disk)  # on disk once preempt() returned
    assert step == 5 and torch.equal(weight, model[0].weight.detach())
    assert ckpt.preempted == record
    ckpt.close()  # after preempt(): only removes the hooks


def test_preempt_stops_waiting_for_a_slow_persistent_tier_at_the_deadline(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    # the first copy to the disk is quick, every later one stalls 3 s: the newest cannot get there in time
    host, slow = host_tier(64 << 20), GatedLocalTier(disk, after=1)
    store = AsymStore([host, slow], durable=host, **FAST)
    model, opt = make()
    ckpt = Checkpointer(model, opt, store, preemption=PreemptionOptions(preempt_on="none"),
                        partitions=PartitionOptions(warmup=1, min_partition_bytes=512))
    train(model, opt, 2)  # version 1 is sealed in the 2nd step
    assert wait_until(lambda: on_disk(disk) == [1])
    train(model, opt, 2)
    record = ckpt.preempt(deadline_s=0.8)
    assert on_disk(disk) == [1]  # it returned while the gated copy still waits: it did not wait for it
    slow.gate.set()
    assert record.step == 4 and record.deadline_s == 0.8
    assert record.deadline_hit and not record.durable
    assert record.persistent_step == 1  # what survives the process had it ended now
    assert 4 in record.versions[host.name]  # committed in memory in time
    assert wait_until(lambda: 4 in on_disk(disk))  # the copy that was cut short goes on in the background


def test_preempt_stops_waiting_for_a_slow_durable_commit_at_the_deadline(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    tier = GatedLocalTier(root, after=2)
    store = AsymStore([tier], **FAST)  # commits 3, 4... wait for the gate
    model, opt = make()
    ckpt = Checkpointer(model, opt, store, preemption=PreemptionOptions(preempt_on="none"),
                        partitions=PartitionOptions(warmup=1, min_partition_bytes=512))
    train(model, opt, 4)  # version 3, sealed in the 4th step, is still committing
    record = ckpt.preempt(deadline_s=1.0)
    assert on_disk(root) == [1, 2]  # it returned while version 3's commit still waits: it did not wait for it
    tier.gate.set()
    assert record.step == 4 and record.deadline_hit and not record.durable
    assert record.persistent_step == 2  # version 3 was not committed in time, version 4 not even sealed
    assert wait_until(lambda: on_disk(root)[-1:] == [3])  # version 3 finishes on its own; 4 was dropped
    assert restored_step_and_weight(root)[0] == 3


def test_preempt_deadline_must_be_positive(tmp_path: Path) -> None:
    model, opt = make()
    try:
        Checkpointer(model, opt, tmp_path / "c",
                     preemption=PreemptionOptions(preempt_on="none", preempt_deadline_s=0.0))
    except ValueError as exc:
        assert "deadline" in str(exc)
    else:
        raise AssertionError("preempt_deadline_s=0 was accepted")
