"""Run tests/procs/ds_settle.py: a one-process real DeepSpeed job (CPU accelerator, gloo), and read what it wrote."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

from tests.support.launch import proc_argv, proc_env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ds_settle(tmp_path: Path, mode: str, world: int = 1) -> dict[str, Any]:
    """Run the child in ``mode`` on ``world`` ranks (its checkpoint under ``tmp_path/ckpt``).

    Returns:
        The JSON it wrote (one rank), or ``{"rank0": ..., "rank1": ...}`` (several).
    """
    out = tmp_path / f"{mode}-RANK.json"
    port = str(_port())
    procs = [subprocess.Popen(
        proc_argv("ds_settle", "--mode", mode, "--dir", str(tmp_path / "ckpt"), "--out", str(out)),
        env=proc_env(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1", RANK=str(rank),
                     WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank}:\n{log[-4000:]}"
    results = {f"rank{rank}": json.loads(Path(str(out).replace("RANK", str(rank))).read_text())
               for rank in range(world)}
    return results["rank0"] if world == 1 else results
