"""FSDP2: a model sharded with ``fully_shard`` on 2 gloo ranks, checkpointed every iteration, then
resumed in a single process that holds the whole model (a resharded resume: 2 ranks -> 1).

Run it as it is: it starts its two ranks itself (as torchrun would), then
resumes in this process, and removes what it wrote.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from asymcheck import Checkpointer

STEPS = 5


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.GELU(), torch.nn.Linear(37, 1))


def train(root: str) -> None:
    """One rank of the FSDP2 job."""
    dist.init_process_group("gloo")
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # --8<-- [start:fsdp2]
    ckpt = Checkpointer(model, optimizer, f"{root}/ckpt")  # a RankStore per rank: shards + a two-phase global commit
    start = ckpt.resume() or 0                            # collective: the newest global version every rank verifies
    # --8<-- [end:fsdp2]
    for step in range(start, STEPS):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    ckpt.close()
    full = {name: t.full_tensor() for name, t in model.state_dict().items()}  # collective
    if dist.get_rank() == 0:
        torch.save(full, f"{root}/expected.pt")
    dist.barrier()  # both ranks leave together: no rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__" and "RANK" in os.environ:
    train(sys.argv[1])
elif __name__ == "__main__":
    root = tempfile.mkdtemp(prefix="asymcheck-fsdp2-")
    try:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, root],
                                  env=dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                           LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                           OMP_NUM_THREADS="1"))
                 for rank in range(2)]
        codes = [p.wait(timeout=120) for p in procs]
        assert codes == [0, 0], f"rank exit codes {codes}"
        model = make_model()                          # one process, no sharding: every tensor whole
        with Checkpointer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), f"{root}/ckpt") as ckpt:
            assert ckpt.resume() == STEPS
        expected = torch.load(f"{root}/expected.pt")
        assert all(torch.equal(t, expected[name]) for name, t in model.state_dict().items())
        print(f"trained on 2 FSDP2 ranks, resumed step {STEPS} whole in 1 process: OK")
    finally:
        shutil.rmtree(root, ignore_errors=True)
