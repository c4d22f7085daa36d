"""FSDP2 resumed by a job that already stepped (AdamW's moments exist), on 2 ranks and on 1 (real processes, gloo).

``save`` trains 3 iterations on 2 ranks with a Checkpointer (a version every iteration) and writes the full
global tensors (parameters, AdamW moments and step) it ended with (``.npy``, no pickle). ``resume`` builds
another model, takes one optimizer step on other data, then ``Checkpointer.resume()``: every parameter and
moment equals the saved global tensor bit for bit, and on 2 ranks (same world: read in place) every local
shard of the live DTensors, parameters and moments alike, is still the same memory (the bytes landed there,
nothing was replaced). On 1 rank the 2-rank version is resharded. Training goes on afterwards.

Run as a test; the ranks run this file's ``child`` (``python -m tests.asymcheck.fsdp2.test_resume_inplace``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.launch import proc_env

pytestmark = pytest.mark.slow

STEPS = 3


def build(seed: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7))  # 33: uneven
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: Any, opt: Any, it: int) -> None:
    import torch

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(it))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    out = {}
    for i, p in enumerate(model.parameters()):
        out[f"p{i}"] = p.detach().full_tensor()
        for key, value in opt.state[p].items():
            out[f"p{i}.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def local_pointers(model: Any, opt: Any) -> dict[str, int]:
    out = {}
    for i, p in enumerate(model.parameters()):
        out[f"p{i}"] = p.to_local().data_ptr()
        for key, value in opt.state[p].items():
            out[f"p{i}.{key}"] = value.to_local().data_ptr() if hasattr(value, "to_local") else value.data_ptr()
    return out


def child(root: Path, phase: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from asymcheck import Checkpointer
    from asymcheck.options import PacingOptions, RetentionOptions

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if phase == "save":
        model, opt = build(0)
        with Checkpointer(model, opt, str(root / "ck"), retention=RetentionOptions(keep_last=2),
                          pacing=PacingOptions(max_overhead=None)):
            for it in range(STEPS):
                step(model, opt, it)
        state = full_state(model, opt)
        if rank == 0:
            for name, t in state.items():
                np.save(root / f"expected-{name}.npy", t.numpy(), allow_pickle=False)
    else:
        model, opt = build(1)
        step(model, opt, 100 + rank)  # the moments exist before the resume, as in a job that resumes mid-run
        before = local_pointers(model, opt)
        ckpt = Checkpointer(model, opt, str(root / "ck"),
                            pacing=PacingOptions(max_overhead=None, save_on_close=False))
        assert ckpt.resume() == STEPS
        state = full_state(model, opt)
        for name, t in state.items():
            want = torch.from_numpy(np.load(root / f"expected-{name}.npy", allow_pickle=False))
            assert t.dtype == want.dtype and torch.equal(t, want), f"rank {rank}: {name} differs"
        if world == 2:  # the same world: every byte was read into the live local shards
            assert local_pointers(model, opt) == before, f"rank {rank}: a live tensor was replaced"
        step(model, opt, STEPS)
        ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} {phase} ok", flush=True)


def launch(root: Path, phase: str, world: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.asymcheck.fsdp2.test_resume_inplace", str(root), phase],
                              env=proc_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                           WORLD_SIZE=str(world), LOCAL_RANK=str(r), OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"rank {r} {phase} ok" in out, f"{phase} rank {r}:\n{out[-4000:]}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch.distributed.fsdp", reason="no FSDP in this torch")
    root = tmp_path_factory.mktemp("fsdp2-inplace")
    launch(root, "save", 2)
    return root


@pytest.mark.parametrize("world", [2, 1])
def test_fsdp2_resume_after_a_step_is_bit_exact_and_in_place(saved: Path, tmp_path: Path, world: int) -> None:
    shutil.copytree(saved, tmp_path / "job")  # the resumed job commits the step it trains after: its own copy
    launch(tmp_path / "job", "resume", world)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    child(Path(sys.argv[1]), sys.argv[2])
