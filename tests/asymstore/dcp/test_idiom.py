"""DCP's own idiom, as PyTorch's recipe writes it: a new ``StorageWriter`` per save over one root, in one process.

Each save commits the step its ``checkpoint_id`` names (the recipe's ``f"checkpoint_step{step}"``, an int, or
``"step-N"``), with no lock error between the writers of one process (they share one open store); a new reader
loads the newest bit-exact and every step by its number; the store closes with the last writer's ``close``. A
second process writing the same root meanwhile is still refused with ``RootLockedError``, nothing written.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asymstore import AsymStore, LocalTier, RootLockedError
from asymstore.dcp import StorageReader, StorageWriter
from asymstore.errors import DCPStorageError
from tests.support import dcp_train as t
from tests.support.launch import proc_argv, proc_env

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]


def lock_is_free(root: Path) -> bool:
    """Whether a store of another kind can open ``root`` for writing now (nothing in this process holds its lock)."""
    async def go() -> None:
        async with AsymStore([LocalTier(root)]):
            pass
    try:
        asyncio.run(go())
    except RootLockedError:
        return False
    return True


@pytest.mark.parametrize("form", ["recipe", "int", "step-N"])
@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_a_new_writer_per_save_commits_each_named_step(tmp_path: Path, mode: str, form: str) -> None:
    root = tmp_path / "ckpt"
    model = t.gpt2()
    opt = t.optimizer(model)
    wants: dict[int, dict[str, str]] = {}
    future = None
    for step in range(1, 4):  # the steps the ids name: 1, 2, 3 (never 0)
        t.train_step(model, opt, step)
        state = t.app_state(model, opt, step)
        wants[step] = t.digests({"model": model.state_dict(), "optim": opt.state_dict()})
        cid: str | int = {"recipe": f"checkpoint_step{step}", "int": step, "step-N": f"step-{step}"}[form]
        if mode == "save":
            dcp.save(state, storage_writer=StorageWriter(root), checkpoint_id=cid)
        else:
            if future is not None:
                future.result()
            future = dcp.async_save(state, storage_writer=StorageWriter(root), checkpoint_id=cid)
    if future is not None:
        future.result()

    with StorageReader(root) as reader:  # a new reader, read-only: the writers' store is still open
        assert reader.steps() == [3, 2, 1]  # each save is a version (keep_last=3 keeps all three)
        model2 = t.gpt2(1)
        opt2 = t.optimizer(model2)
        state = t.app_state(model2, opt2, -1)
        dcp.load(state, storage_reader=reader)
        t.apply_state(model2, opt2, state)
        assert reader.step == 3 and state["step"] == 3
        assert t.digests({"model": model2.state_dict(), "optim": opt2.state_dict()}) == wants[3]
        for step in (1, 2):
            dcp.load(state, storage_reader=reader, checkpoint_id=step)
            t.apply_state(model2, opt2, state)
            assert reader.step == step and state["step"] == step
            assert t.digests({"model": model2.state_dict(), "optim": opt2.state_dict()}) == wants[step]

    # the store the dropped writers shared is open until a writer of the root is closed (or the process exits)
    gc.collect()
    assert not lock_is_free(root)
    last = StorageWriter(root)
    dcp.save(t.app_state(model, opt, 4), storage_writer=last, checkpoint_id=4)
    assert last.last_step == 4
    last.close()
    gc.collect()
    assert lock_is_free(root)  # closed with the last writer: another store (or process) may write now


def test_writers_of_one_root_share_one_save_at_a_time(tmp_path: Path) -> None:
    """Two live writers of one root: steps only go forward across them, and options must agree."""
    root = tmp_path / "ckpt"
    a, b = StorageWriter(root), StorageWriter(root)
    dcp.save({"w": torch.ones(2)}, storage_writer=a, checkpoint_id=5)
    with pytest.raises(CheckpointException) as info:  # b knows a's step: 5 is taken
        dcp.save({"w": torch.zeros(2)}, storage_writer=b, checkpoint_id=5)
    assert "StepCommittedError" in str(info.value) or "not newer" in str(info.value)
    dcp.save({"w": torch.zeros(2)}, storage_writer=b)  # the next step after a's
    assert b.last_step == 6
    with pytest.raises(DCPStorageError, match="same options"):
        StorageWriter(root, keep_last=None).open()
    a.close()
    assert not lock_is_free(root)  # b still holds the store
    b.close()
    assert lock_is_free(root)
    with StorageReader(root) as reader:
        back = {"w": torch.full((2,), 9.0)}
        dcp.load(back, storage_reader=reader)
        assert reader.step == 6 and torch.equal(back["w"], torch.zeros(2))
    dcp.save({"w": torch.ones(2)}, storage_writer=StorageWriter(root), checkpoint_id=9)  # dropped unclosed
    gc.collect()
    assert not lock_is_free(root)
    StorageWriter(root).close()  # a writer that never saved closes what the dropped one left open
    assert lock_is_free(root)


def test_a_second_process_on_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (1, 2):  # the idiom: the store the writers share stays open in this process
        dcp.save({"w": torch.full((3,), float(step))}, storage_writer=StorageWriter(root), checkpoint_id=step)
    holder = StorageWriter(root)
    holder.open()
    try:
        other = subprocess.run(proc_argv("dcp_child", "save", str(root), "7"), env=proc_env(OMP_NUM_THREADS="1"),
                               capture_output=True, text=True, timeout=120, check=False)
        assert other.returncode == 0, other.stdout[-3000:] + other.stderr[-3000:]
        assert "failed: RootLockedError" in other.stdout, other.stdout + other.stderr[-3000:]
        with StorageReader(root) as reader:
            assert reader.steps() == [2, 1]  # nothing of the refused save was written
    finally:
        gc.collect()
        holder.close()
    again = subprocess.run(proc_argv("dcp_child", "save", str(root), "7"), env=proc_env(OMP_NUM_THREADS="1"),
                           capture_output=True, text=True, timeout=120, check=False)
    assert "saved" in again.stdout, again.stdout + again.stderr[-3000:]  # the lock went with the last writer
    with StorageReader(root) as reader:
        assert reader.steps() == [7, 2, 1]
