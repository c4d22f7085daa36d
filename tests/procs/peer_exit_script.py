"""A user's training script on one rank, in a process of its own as torchrun starts it.

Run by tests/asymstore/tiers/peer/test_multirank.py.

``python -m tests.procs.peer_exit_script CASE.json RANK``

The README's peer layout (a RankStore with the memory tier durable: [host_tier in shared memory, PeerTier,
LocalTier]) under plain DDP (gloo), training ``iterations`` with a Checkpointer. Each iteration appends
``{"it"}`` to ``OUT/progress-rankR.jsonl``; when the program's main function ends, however it ends, the
wall-clock time is written to ``OUT/ended-rankR.json`` (with the exception that ended it), and the
interpreter then exits as any script does: ``exit: "propagate"`` lets the exception out of the script
(a traceback, exit status 1), ``exit: "catch"`` catches it and returns (status 0); ``exit: "forget"``
returns after the last iteration without closing the Checkpointer.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


def main(case: dict[str, Any], rank: int, out: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from asymcheck import Checkpointer
    from asymcheck.options import PartitionOptions
    from asymstore import LocalTier, host_tier
    from asymstore.format.names import rank_dirname
    from asymstore.multirank import RankStore
    from asymstore.tiers.peer import PeerTier

    per_node, world = case["per_node"], case["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(case["port"]), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=case["timeout_s"]))
    torch.manual_seed(1234)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    node = Path(case["shm"]) / f"node-{rank // per_node}"
    memory = host_tier(64 << 20, path=node / "own" / rank_dirname(rank))
    store = RankStore(case["dir"], durable=memory.name, tiers=[
        memory, PeerTier(64 << 20, path=node / "replicas"), LocalTier(Path(case["dir"]) / rank_dirname(rank))])
    ckpt = Checkpointer(model, opt, store, partitions=PartitionOptions(warmup=1, min_partition_bytes=512))
    start = ckpt.resume() or 0
    try:
        for it in range(start, case["iterations"]):
            time.sleep(case["step_s"])
            g = torch.Generator().manual_seed(it * 1000 + rank)
            x = torch.randn(8, 16, generator=g)
            loss = nn.functional.mse_loss(model(x), x.flip(1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with open(out / f"progress-rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"it": it}) + "\n")
    except Exception as exc:
        if case["exit"] != "catch":
            raise
        print(f"training failed: {exc}", file=sys.stderr)  # and the script returns
        peer = next(t for t in store.status().values() if t.name.startswith("peer:"))
        (out / f"status-rank{rank}.json").write_text(json.dumps({"peer_error": peer.last_error}))
        return
    if case["exit"] != "forget":
        ckpt.close()


class SlowTeardown:
    """Held by the script's globals: the interpreter's finalization, which drops them, takes ``seconds`` longer
    (as a large program's teardown does); ``atexit`` callbacks, the last step before it, write ``OUT/finalizing-rankR``
    (the test can kill a peer just then)."""

    def __init__(self, out: Path, rank: str, seconds: float) -> None:
        self.seconds = seconds
        atexit.register(lambda: (out / f"finalizing-rank{rank}").touch())

    def __del__(self) -> None:
        time.sleep(self.seconds)


if __name__ == "__main__":
    case_path, rank_arg = sys.argv[1:3]
    spec: dict[str, Any] = json.loads(Path(case_path).read_text())
    out_dir = Path(spec["out"])
    teardown = SlowTeardown(out_dir, rank_arg, spec.get("teardown_s", 0.0))
    ended: dict[str, Any] = {"error": None}
    try:
        main(spec, int(rank_arg), out_dir)
    except BaseException as exc:
        ended["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        raise
    finally:
        ended["t"] = time.time()
        (out_dir / f"ended-rank{rank_arg}.json").write_text(json.dumps(ended))
