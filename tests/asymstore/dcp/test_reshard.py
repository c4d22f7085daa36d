"""DCP's own resharding over asymstore versions, with FSDP2 (``fully_shard``) on 2 gloo ranks on CPU.

2 -> 1: the FSDP2 job trains and saves (``dcp.async_save``) into a directory (each rank's shard of a RankStore,
then the global manifest); one process loads it into an unsharded model. 1 -> 2: one process saves an unsharded
model; the FSDP2 job loads it into its sharded model. Each time the whole state (parameters and AdamW state, as torch's
full state dict gives it) is bit-identical to what was saved. The model's shards are uneven (37 rows: 19 and
18) and its last layer leaves rank 1 an empty piece. fsck finds the multi-rank root clean.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asymstore.dcp import StorageReader, StorageWriter
from tests.support import dcp_train as t

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def test_two_ranks_to_one_and_one_to_two(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="no FSDP2 in this torch")
    model = t.small_model(shard=False)
    opt = optimizer(model)
    for step in range(2):
        t.small_step(model, opt, step, 0)
    state = t.app_state(model, opt, 0)
    with StorageWriter(tmp_path / "root1") as writer:
        dcp.save({"model": state["model"], "optim": state["optim"]}, storage_writer=writer)
    saved1 = t.full_digests(model, opt)

    t.run_ranks(2, "reshard", str(tmp_path))  # saves root2 on 2 ranks, loads root1 on 2 ranks

    assert t.read_json(tmp_path / "full1.json") == saved1  # 1 -> 2
    model = t.small_model(shard=False)
    opt = optimizer(model)
    state = t.app_state(model, opt, 0)
    state = {"model": state["model"], "optim": state["optim"]}
    with StorageReader(tmp_path / "root2") as reader:
        dcp.load(state, storage_reader=reader)
        assert reader.step == 0 and reader.fallbacks == []
    t.apply_state(model, opt, {**state, "rng": torch.get_rng_state()})
    assert t.full_digests(model, opt) == t.read_json(tmp_path / "full2.json")  # 2 -> 1

    assert sorted(p.name for p in (tmp_path / "root2").iterdir()) == [  # LAYOUT.json: the root's layout, recorded;
        ".lock", "LAYOUT.json", "global", "rank-00000", "rank-00001"]  # .lock: held until the first global version
    done = t.fsck(tmp_path / "root2", "--deep")
    assert done.returncode == 0 and "verdict: OK" in done.stdout, done.stdout + done.stderr
