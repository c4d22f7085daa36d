"""FSDP2 (``fully_shard``, gloo, 2 CPU ranks) under a Checkpointer: a typed refusal, never a signal.

Before issue 9 the Checkpointer's copy thread read the raw pointers of FSDP2's DTensor parameters and
both ranks died by SIGSEGV. Now the Checkpointer refuses tensor subclasses at construction with
``UnsupportedModelError`` naming the class, and the ranks go on training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _mr_harness import free_ports

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("_fsdp2_child.py")
ROOT = Path(__file__).resolve().parent.parent


def test_fsdp2_model_is_refused_with_a_typed_error_and_no_rank_dies(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="no FSDP in this torch")
    [port] = free_ports(1)
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(CHILD), "--dir", str(tmp_path / f"r{rank}")],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=180) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode} (a negative code is a signal):\n{err[-3000:]}"
        events = {e["event"]: e for e in map(json.loads, out.splitlines())}
        assert events["built"]["param_type"] == "DTensor"  # really FSDP2
        refused = events["refused"]
        assert refused["error"] == "UnsupportedModelError"
        assert "DTensor" in refused["message"] and "model/0.weight" in refused["message"]
        assert len(events["trained"]["losses"]) == 4  # FSDP2 itself still trains after the refusal
