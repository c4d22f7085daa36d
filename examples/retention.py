"""Retention for long runs: the newest versions, a milestone every N steps, the best by a metric."""

import tempfile

import torch

from asymcheck import Checkpointer
from asymcheck.options import RetentionOptions
from asymstore import KeepBest

model = torch.nn.Linear(16, 16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

with tempfile.TemporaryDirectory() as root:
    # --8<-- [start:retention]
    keep = RetentionOptions(keep_last=2, keep_every=10, keep_best=KeepBest("eval_loss", mode="min", k=1))
    with Checkpointer(model, optimizer, root, retention=keep) as ckpt:
        for step in range(30):
            model(torch.randn(8, 16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % 5 == 0:                       # an evaluation after this step
                ckpt.log_metrics({"eval_loss": abs(step + 1 - 15) / 10})
    # kept: steps 10, 20, 30 (keep_every), 15 (the best eval_loss), 29 and 30 (keep_last)
    # --8<-- [end:retention]
    print(ckpt.final_versions)
    assert ckpt.final_versions == {f"local:{root}": [10, 15, 20, 29, 30]}
