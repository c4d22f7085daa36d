"""One torchft replica group of one rank, healing through asymstore.torchft.StoreTransport (a real process).

Trains a small MLP with torchft's Manager over ProcessGroupGloo (``start_quorum``, ``should_commit``), averaging
gradients with ``manager.allreduce`` (torchft 0.2.0's ``torchft.ddp.DistributedDataParallel`` asserts
in its comm hook when an allreduce fails at once, as it does after the other group died, and takes
the healthy group down with it); each committed step is saved to the group's store (memory tier durable, a local
disk behind it). Writes JSON lines to ``OUT``: ``{"step": n, "loss": x}`` per committed step (the
loss of the iteration that produced step n), ``{"saved": n, "digest": d}`` per saved version,
``{"healed": {...}, "digest": d}`` after a heal is applied, ``{"final": {...}}`` at the end.

Usage: python -m tests.procs.torchft_group REPLICA_ID LIGHTHOUSE STEPS ROOT OUT QUORUM [RANK WORLD PORT]
(QUORUM ``sync``: torchft's synchronous quorum, the heal applied in ``start_quorum``; ``async``: asynchronous;
``sync+init``: synchronous with torchft's ``init_sync``, each group seeded with its own id, so that a group
heals at step 0 from the other's version 0.
RANK of WORLD ranks of the group, whose TCPStore rank 0 serves on PORT; default one rank. Each rank trains
its own data and averages with the same rank of the other group, as torchft pairs them.)
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from asymstore import AsymStore, LocalTier, Tier, host_tier
from asymstore.torchft import StoreTransport


def batch(group: int, rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``index``-th batch of the shard of ``rank`` of ``group`` (a pure function of the three)."""
    g = torch.Generator().manual_seed(100_000 * rank + 1000 * group + index)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


class Batches:
    """The group's data position: batches of its shard trained in committed steps."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    rid, lighthouse, steps, root, out = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]),
                                         Path(sys.argv[5]))
    rank, world, port = (int(a) for a in sys.argv[7:10]) if len(sys.argv) > 7 else (0, 1, 0)
    torch.set_num_threads(1)
    log = out.open("a")

    def emit(record: dict[str, Any]) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    quorum = sys.argv[6]
    init_sync = quorum.endswith("+init")
    torch.manual_seed(rid if init_sync else 0)  # without init_sync every group starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    position = Batches()
    transport: StoreTransport

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        emit({"healed": {"step": transport.healed.step, "group": transport.healed.source_group,
                         "tier": transport.healed.source_tier} if transport.healed else None,
              "digest": digest(model)})

    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0,  # type: ignore[attr-defined]
                          wait_for_workers=False)
    tiers: list[Tier] = [host_tier(64 << 20, name="memory"), LocalTier(root / f"group-{rid}" / f"rank-{rank}")]
    transport = StoreTransport(AsymStore(tiers, durable="memory", calibration_cache=False, keep_last=4,
                                         segment_bytes=1 << 20, compression="never"),
                               replica_group=str(rid))
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=load, state_dict=state,
                      min_replica_size=2, replica_id=str(rid), store_addr="127.0.0.1", store_port=store.port,
                      rank=rank, world_size=world, lighthouse_addr=lighthouse, checkpoint_transport=transport,
                      timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=10), init_sync=init_sync,
                      use_async_quorum=not quorum.startswith("sync"))
    transport.attach(manager, {"default": state}, position=position)
    transport.save()  # version 0: the initial weights
    try:
        while manager.current_step() < steps:
            manager.start_quorum()
            inner.zero_grad()
            x, y = batch(rid, rank, position.n)
            loss = F.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            for work in [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]:
                work.wait()
            if manager.should_commit():
                inner.step()
                position.n += 1
                emit({"step": manager.current_step(), "loss": loss.item()})
                transport.save()
                emit({"saved": manager.current_step(), "digest": digest(model)})
                print(f"STEP {manager.current_step()}", flush=True)
        emit({"final": {k: v.tolist() for k, v in model.state_dict().items()}, "digest": digest(model),
              "served": transport.served_steps})
    finally:
        manager.shutdown(wait=False)
        transport.shutdown()


if __name__ == "__main__":
    main()
