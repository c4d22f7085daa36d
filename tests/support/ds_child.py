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


def run_ds_settle(tmp_path: Path, mode: str) -> dict[str, Any]:
    """Run the child in ``mode`` (its checkpoint under ``tmp_path/ckpt``); return the JSON it wrote."""
    out = tmp_path / f"{mode}.json"
    env = proc_env(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    done = subprocess.run(proc_argv("ds_settle", "--mode", mode, "--dir", str(tmp_path / "ckpt"), "--out", str(out)),
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result
