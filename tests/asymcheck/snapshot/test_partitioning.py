"""``Checkpointer(partitioning=...)``: every mode takes bit-exact versions of a real training run and resumes from them.

Per mode, a short run checkpoints every step; each version is compared with the
state the loop saw at that step, the newest one is damaged so that the resume
falls back to a version copied in the mode's own partitions during the next
iteration, and the resumed run must end bit-identical (parameters, optimizer
state, scheduler, RNG, every loss) to one uninterrupted run without a
Checkpointer. The step records must show where each mode copied: ``"step"``
everything at the boundary, the others in the forward and backward hooks
(``"uniform"`` about half in each).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from asymcheck import PARTITIONINGS, InvalidOptionError, Partitioning
from asymcheck.options import PacingOptions
from asymcheck.snapshot.copyengine import CopyEngine, CopyJob
from tests.support.asymcheck_train import (
    Recorder,
    check_version,
    corrupt_newest_segment,
    data,
    equal_state,
    fast_partitions,
    make_model,
    make_opt,
    open_ckpt,
    read_versions,
    tensors_of,
)

STEPS = 14  # the uninterrupted run
FIRST = 10  # steps of the first run; its version 10 is damaged, so the resume starts at 9
HIDDEN = 256  # ~1 MiB of state with AdamW: big enough that a copy takes measurable time


def iteration(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, it: int) -> float:
    x, y = data(it)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def everything(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    out: dict[str, Any] = tensors_of({"model": model.state_dict(), "opt": opt.state_dict(),
                                      "sched": sched.state_dict(), "rng": torch.get_rng_state()})
    return out


def uninterrupted() -> tuple[list[float], dict[str, Any]]:
    model = make_model(hidden=HIDDEN)
    opt, sched = make_opt(model)
    losses = [iteration(model, opt, sched, it) for it in range(STEPS)]
    return losses, everything(model, opt, sched)


@pytest.mark.parametrize("mode", PARTITIONINGS)
def test_every_mode_is_bit_exact_and_resumes_like_an_uninterrupted_run(tmp_path: Path, mode: Partitioning) -> None:
    want_losses, want_final = uninterrupted()

    # the first run: a version every step, each compared with the state the loop saw
    model = make_model(hidden=HIDDEN)
    opt, sched = make_opt(model)
    rec = Recorder()
    losses = []
    with open_ckpt(model, opt, tmp_path, stateful={"sched": sched}, partitions=fast_partitions(partitioning=mode),
                   pacing=PacingOptions(max_overhead=None)) as ckpt:
        assert ckpt.partitioning == mode
        rec.hook(model, opt, lambda: ckpt.step)
        for it in range(FIRST):
            losses.append(iteration(model, opt, sched, it))
            rec.end_of_body(ckpt.step, opt, {"sched": sched})
    assert losses == want_losses[:FIRST]  # checkpointing changes nothing in training
    versions = read_versions(tmp_path)
    assert sorted(versions) == list(range(1, FIRST + 1))
    for ck in versions.values():
        fresh = make_model(seed=99, hidden=HIDDEN)
        fresh_opt, fresh_sched = make_opt(fresh)
        check_version(ck, rec, fresh, fresh_opt, {"sched": fresh_sched})
        assert ck.meta["asymcheck"]["plan"]["partitioning"] == mode

    # where each mode copied: the records of the steps that sealed a version with the sized plan
    plan = ckpt.plan
    assert plan is not None and plan.warm and plan.partitioning == mode
    records = [r for r in ckpt.stats().steps if r.sealed][3:]  # after the warm-up (2 iterations) and its plan
    assert records and all(r.copy_bytes == plan.total_bytes for r in records)
    for r in records:
        assert r.forward_bytes + r.backward_bytes + r.boundary_bytes == r.copy_bytes
        if mode == "step":
            assert r.boundary_bytes == r.copy_bytes and r.forward_bytes == r.backward_bytes == 0
        else:  # every event fired: nothing left for the boundary
            assert r.boundary_bytes == 0 and r.forward_bytes > 0 and r.backward_bytes > 0
        if mode == "uniform":
            assert abs(r.forward_bytes - r.backward_bytes) <= r.copy_bytes // len(plan.partitions)
    copy_s = sum(r.copy_s for r in records)
    assert copy_s > 0 and all(0 <= r.overlap_s <= r.copy_s for r in records)
    if mode == "step":  # copied while the step pre-hook waited: nothing overlapped training
        assert sum(r.overlap_s for r in records) <= 0.5 * copy_s
    assert 0.0 <= ckpt.stats().summary()["copy_overlap_fraction"] <= 1.0

    # the newest version is lost: the resume falls back to version 9, copied by the mode's partitions
    corrupt_newest_segment(tmp_path, FIRST)
    model = make_model(seed=7, hidden=HIDDEN)
    opt, sched = make_opt(model)
    with open_ckpt(model, opt, tmp_path, stateful={"sched": sched}, partitions=fast_partitions(partitioning=mode),
                   pacing=PacingOptions(max_overhead=None)) as ckpt:
        assert ckpt.resume() == FIRST - 1
        resumed = [iteration(model, opt, sched, it) for it in range(FIRST - 1, STEPS)]
    assert resumed == want_losses[FIRST - 1:]
    equal_state(want_final, everything(model, opt, sched))


def test_an_unknown_partitioning_is_refused_before_anything_is_hooked(tmp_path: Path) -> None:
    model = make_model()
    opt, _ = make_opt(model)
    with pytest.raises(InvalidOptionError, match="got 'symmetric'"):
        open_ckpt(model, opt, tmp_path, partitions=fast_partitions(partitioning="symmetric"))
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks
    # the root was not locked either
    with open_ckpt(model, opt, tmp_path, partitions=fast_partitions(partitioning="uniform")) as ckpt:
        assert ckpt.partitioning == "uniform"


def test_copy_engine_tells_blocked_copy_time_from_overlapped() -> None:
    src = torch.ones(16 << 20, dtype=torch.uint8)  # 16 MiB: milliseconds of memmove

    def job(dst: torch.Tensor) -> CopyJob:
        return CopyJob(src, dst, 0, src.numel())

    engine = CopyEngine("thread")
    try:
        engine.submit([job(torch.zeros_like(src))])
        engine.wait()  # right away: the caller blocks for (nearly) all of it
        assert 0 < engine.blocked_seconds <= engine.busy_seconds
        blocked, busy = engine.blocked_seconds, engine.busy_seconds
        engine.submit([job(torch.zeros_like(src))])
        deadline = time.monotonic() + 30
        while engine.busy_seconds == busy and time.monotonic() < deadline:  # done before anyone waits
            time.sleep(0.005)
        engine.wait()
        assert engine.busy_seconds > busy and engine.blocked_seconds == blocked  # all of it overlapped
    finally:
        engine.close()
    inline = CopyEngine("inline")
    inline.submit([job(torch.zeros_like(src))])
    assert inline.blocked_seconds == inline.busy_seconds > 0  # in the caller's hook: nothing overlaps
