"""``AsymCheckManager`` resumed on another parallelism: FSDP2 on 2 ranks (gloo, CPU) -> one process without FSDP.

The job trains 4 steps on 2 ranks with FSDP2 (``fully_shard`` on each block and the root, TorchTitan's
layout), TorchTitan's ``OptimizersContainer`` over the sharded parameters and its ``ParallelAwareDataloader``
of each rank, a version every step (tests/procs/titan_train.py ``--fsdp``). One process then resumes the
root with ``exclude_from_loading=["dataloader"]`` (a loader's position taken on data-parallel rank 0 of 2
is refused otherwise: test_manager.py): every parameter and AdamW moment comes back as the whole tensor the
2-rank job ended with (gathered there), bit for bit, with its train state, scheduler and param groups, and
training goes on.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.launch import proc_argv, proc_env
from tests.support.mr_harness import free_ports

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is not installed")

pytestmark = pytest.mark.slow


def run(out: Path, world: int, *args: str) -> list[int]:
    """Run the child on ``world`` ranks (``--fsdp`` when more than one); return every rank's exit code."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_ports(1)[0])
    procs = []
    for rank in range(world):
        env = proc_env(OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(out / f"hf-cache-{rank}"), HF_HUB_OFFLINE="1")
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        log = open(out / f"log-rank{rank}", "wb")
        argv = proc_argv("titan_train", "--out", str(out), *args,
                         *(["--fsdp"] if world > 1 else []))
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))
    return [p.wait(timeout=300) for p in procs]


def whole(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(path).items() if k != "rng"}


def test_fsdp2_job_of_two_ranks_resumes_in_one_process(tmp_path: Path) -> None:
    dump = str(tmp_path / "dump")
    codes = run(tmp_path / "two", 2, "--dir", dump, "--steps", "4")
    assert codes == [0, 0], (tmp_path / "two" / "log-rank0").read_text()[-4000:]
    codes = run(tmp_path / "one", 1, "--dir", dump, "--steps", "6", "--exclude", "dataloader",
                "--dump-resumed")
    assert codes == [0], (tmp_path / "one" / "log-rank0").read_text()[-4000:]
    events = [json.loads(line) for line in (tmp_path / "one" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [4]
    want, got = whole(tmp_path / "two" / "final.safetensors"), whole(tmp_path / "one" / "resumed.safetensors")
    assert sorted(got) == sorted(want) and any(k.startswith("optim/") for k in want)
    for name, x in want.items():
        y = got[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
    before = json.loads((tmp_path / "two" / "final.json").read_text())
    after = json.loads((tmp_path / "one" / "resumed.json").read_text())
    assert after == before  # train state, scheduler, param groups (the LR) of step 4
    final = json.loads((tmp_path / "one" / "final.json").read_text())
    assert final["train_state"]["step"] == 6
