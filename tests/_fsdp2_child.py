"""One rank of the FSDP2 test (run as a script by tests/test_asymcheck_fsdp2.py, never imported by pytest).

Builds a three-layer MLP, shards every layer and the root with ``fully_shard`` (gloo, CPU), and puts it
under a Checkpointer. The Checkpointer refuses tensor subclasses (FSDP2's DTensor parameters) at
construction with a typed error; the rank reports what happened as one JSON line per event on stdout,
then trains a few steps without checkpoints to show the process (and FSDP2) are intact.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    emit(event="built", rank=rank, param_type=type(next(model.parameters())).__name__)

    from asymcheck import Checkpointer
    from asymstore.errors import AsymstoreError

    try:
        ckpt = Checkpointer(model, opt, os.path.join(args.dir, "ckpt"))
    except AsymstoreError as exc:
        emit(event="refused", rank=rank, error=type(exc).__name__, message=str(exc))
        ckpt = None
    losses = []
    with ckpt if ckpt is not None else _Null():
        if ckpt is not None:
            ckpt.resume()
        for it in range(4):
            g = torch.Generator().manual_seed(it * 10 + rank)
            x = torch.randn(8, 16, generator=g)
            loss = nn.functional.mse_loss(model(x), x[:, :4])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    emit(event="trained", rank=rank, losses=losses, checkpointed=ckpt is not None)
    dist.barrier()
    dist.destroy_process_group()
    return 0


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
