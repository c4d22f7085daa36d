"""Losing a node: 2 DDP ranks as 2 simulated nodes of 1 rank, gloo on CPU.

Each rank's tiers are its node's shared memory (the durable tier), a
``PeerTier`` (its replicas in the memory of the rank on the next node) and
its node's own disk; ``global/`` (the commit point of every version) is on
shared storage. The job trains, ends, and node 1 is then lost with its
memory and its disk: the restarted job resumes rank 1 from the replica
node 0 holds. Run it as it is: it starts its two ranks itself (as torchrun
would) and removes what it wrote.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from asymcheck import Checkpointer
from asymstore import LocalTier, host_tier
from asymstore.multirank import RankStore
from asymstore.tiers.peer import PeerTier

STEPS = 6


def train(shared: str, shm: str, local_nvme: str) -> None:
    """One rank of the job; ``shm`` and ``local_nvme`` belong to this rank's node."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # --8<-- [start:tiers]
    rank = int(os.environ["RANK"])
    memory = host_tier(64 << 20, path=f"{shm}/ckpt/rank-{rank}")              # survives the process
    store = RankStore(f"{shared}/ckpt", durable=memory.name, tiers=[          # global/ on shared storage
        memory,
        PeerTier(64 << 20, path=f"{shm}/ckpt/replicas"),                     # survives the node
        LocalTier(f"{local_nvme}/ckpt/rank-{rank}")])                        # survives a job restart
    ckpt = Checkpointer(model, optimizer, store)    # DeepSpeed: asymcheck.deepspeed.attach(engine, store)
    start = ckpt.resume() or 0                      # collective; ckpt.restored.tier says where from
    # --8<-- [end:tiers]
    print(f"rank {rank}: resumed at step {start} from {ckpt.restored.tier if ckpt.restored else None}", flush=True)
    for _step in range(start, STEPS):
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    ckpt.close()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(base: str) -> list[str]:
    """Start both ranks, as torchrun would (one rank per node: LOCAL_WORLD_SIZE=1); return their output."""
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        args = [sys.executable, __file__, f"{base}/shared", f"{base}/node-{rank}/shm", f"{base}/node-{rank}/disk"]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    return outputs


if __name__ == "__main__" and "RANK" in os.environ:
    train(*sys.argv[1:4])
elif __name__ == "__main__":
    base = tempfile.mkdtemp(prefix="asymstore-peer-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    try:
        print("".join(job(base)), end="")            # trains steps 0-6
        shutil.rmtree(f"{base}/node-1")               # node 1 is lost: its memory and its disk
        outputs = job(base)                           # the restarted job
        print("".join(outputs), end="")
        assert f"resumed at step {STEPS} from peer:" in outputs[1], outputs[1]
        print("node 1 resumed from its replica on node 0: OK")
    finally:
        shutil.rmtree(base, ignore_errors=True)
