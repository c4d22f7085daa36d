"""The Checkpointer's options, typed: groups by concern, forwarded by an integration as ``**options``."""

import tempfile
from typing import Unpack

import torch

from asymcheck import Checkpointer
from asymcheck.options import CheckpointerOptions, PacingOptions, PartitionOptions, RetentionOptions

model = torch.nn.Linear(16, 16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

with tempfile.TemporaryDirectory() as root:
    # --8<-- [start:groups]
    with Checkpointer(model, optimizer, root,
                      retention=RetentionOptions(keep_last=2),
                      partitions=PartitionOptions(partitioning="uniform"),
                      pacing=PacingOptions(max_overhead=None)) as ckpt:   # a version every step
        for _ in range(5):
            model(torch.randn(8, 16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    print(ckpt.options.retention)          # RetentionOptions(keep_last=2, keep_every=None, keep_best=None)
    # --8<-- [end:groups]
    assert ckpt.final_versions == {f"local:{root}": [4, 5]}


# --8<-- [start:forward]
def my_integration(model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: str,
                   **options: Unpack[CheckpointerOptions]) -> Checkpointer:
    """An integration's entry point: mypy checks every option its callers pass."""
    return Checkpointer(model, optimizer, root, **options)
# --8<-- [end:forward]


with tempfile.TemporaryDirectory() as root:
    ckpt = my_integration(model, optimizer, root, retention=RetentionOptions(keep_last=1))
    ckpt.close()
    assert ckpt.options.retention.keep_last == 1
