"""Fast steps, a version at every one: shared memory takes every version, the disk the newest it can.

``commit`` waits for the tier named ``durable``: here the shared-memory tier, which outlives a crash of
the training process (not of the machine) and holds at most ``capacity_bytes``. The directory gets
each version in the background; when a newer version arrives while one is still waiting for the
disk, the waiting one is skipped there (``backlog=1``). ``resume()`` takes the newest version that
verifies on either tier.
"""

import os
import tempfile

import torch

from asymcheck import Checkpointer
from asymcheck.options import PacingOptions
from asymstore import AsymStore, LocalTier, host_tier

shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else None


def train(ckpt: Checkpointer, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory(dir=shm_parent) as shm:
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters())
    # --8<-- [start:memory-first]
    memory = host_tier(256 << 20, path=shm)           # e.g. /dev/shm/job42: survives the process, bounded
    store = AsymStore([memory, LocalTier(root)], durable=memory, keep_last=3)
    ckpt = Checkpointer(model, optimizer, store, pacing=PacingOptions(max_overhead=None))
    # --8<-- [end:memory-first]
    train(ckpt, model, optimizer, 5)
    ckpt.close()  # waits for the directory to catch up (close_timeout_s)
    assert ckpt.final_versions[memory.name][-1] == 5

    # a restarted process (same node) resumes from shared memory, or from the directory
    model2 = torch.nn.Linear(16, 16)
    optimizer2 = torch.optim.AdamW(model2.parameters())
    store2 = AsymStore([host_tier(256 << 20, path=shm), LocalTier(root)], durable=memory.name, keep_last=3)
    with Checkpointer(model2, optimizer2, store2, pacing=PacingOptions(max_overhead=None)) as ckpt2:
        assert ckpt2.resume() == 5
        assert torch.equal(model2.weight, model.weight)
