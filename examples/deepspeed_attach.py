"""DeepSpeed: a checkpoint every iteration of a ZeRO-2 job (2 ranks, gloo, DeepSpeed's CPU accelerator),
then the newest version written out as DeepSpeed's own checkpoint files and consolidated by DeepSpeed's
``zero_to_fp32``.

Run it as it is: it starts its two ranks itself (as the deepspeed launcher
would), then runs the export commands, and removes what it wrote. The first
run on a machine also builds DeepSpeed's shared-memory communication op
(about half a minute; DeepSpeed caches it).
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import deepspeed
import torch

import asymcheck.deepspeed

STEPS = 4


def train(root: str) -> None:
    """One rank of the DeepSpeed job: train to STEPS, resuming from what ``root/ckpt`` holds."""
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
    # --8<-- [start:attach]
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    ckpt = asymcheck.deepspeed.attach(engine, f"{root}/ckpt")  # a snapshot every iteration, ZeRO 0-3
    start = ckpt.resume() or 0                                 # collective; optimizer steps already done
    # --8<-- [end:attach]
    for _step in range(start, STEPS):
        loss = engine(torch.randn(4, 16)).square().mean()
        engine.backward(loss)
        engine.step()
    ckpt.close()                                               # commits the last step
    print(f"rank {engine.global_rank}: resumed at {start}, ended at {engine.global_steps}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(root: str) -> str:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, root], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1"))
             for rank in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    return "".join(outputs)


if __name__ == "__main__" and "RANK" in os.environ:
    train(sys.argv[1])
elif __name__ == "__main__":
    root = tempfile.mkdtemp(prefix="asymcheck-deepspeed-")
    try:
        print(job(root), end="")
        os.chdir(root)
        for command in (["asymcheck.deepspeed.export", "ckpt", "ds-out"],
                        ["deepspeed.utils.zero_to_fp32", "ds-out", "weights/", "--safe_serialization"]):
            print("$ python -m", " ".join(command))
            subprocess.run([sys.executable, "-m", *command], check=True, capture_output=True,
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
        print(sorted(os.listdir("weights")))
        print("DeepSpeed attach, resume, export and zero_to_fp32: OK")
    finally:
        os.chdir("/")
        shutil.rmtree(root, ignore_errors=True)
