"""Pytest-side helpers of the multi-rank tests: launch one driver per rank, read what the cases left."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from asymstore import AsymStore, LocalTier
from asymstore.values import Checkpoint
from tests.support.launch import proc_argv, proc_env


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_cases(cases: list[dict[str, Any]], world: int, out: Path, timeout: float = 900) -> None:
    """Run every case on ``world`` ranks (one driver process per rank); raise if a driver failed."""
    out.mkdir(parents=True, exist_ok=True)
    for case, port in zip(cases, free_ports(len(cases)), strict=True):
        case.setdefault("port", port)
    spec = out / "cases.json"
    spec.write_text(json.dumps(cases))
    env = proc_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    # each driver writes into a file of its own: a pipe read one rank after the other fills (64 KiB) while the
    # first is waited for, and the rank writing into it then blocks in every case after (every case fails)
    paths = [out / f"driver-rank{r}.log" for r in range(world)]
    files = [path.open("w") for path in paths]
    try:
        procs = [subprocess.Popen(proc_argv("mr_driver", "--rank", str(r), "--world", str(world),
                                            "--cases", str(spec), "--out", str(out)),
                                  stdout=files[r], stderr=subprocess.STDOUT, text=True, env=env)
                 for r in range(world)]
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for f in files:
            f.close()
    for r, (p, path) in enumerate(zip(procs, paths, strict=True)):
        assert p.returncode == 0, f"driver of rank {r} failed:\n{path.read_text()[-4000:]}"


class Case:
    """What one case left under ``out/<name>``."""

    def __init__(self, out: Path, name: str, world: int) -> None:
        self.dir = out / name
        self.world = world

    def rc(self, rank: int) -> int:
        return int(json.loads((self.dir / f"rc-rank{rank}.json").read_text())["rc"])

    def log(self, rank: int) -> str:
        return (self.dir.parent / f"driver-rank{rank}.log").read_text()[-3000:]

    def events(self, rank: int, kind: str) -> list[dict[str, Any]]:
        path = self.dir / f"events-rank{rank}.jsonl"
        if not path.exists():
            return []
        return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]

    def losses(self, rank: int) -> list[tuple[int, str]]:
        path = self.dir / f"losses-rank{rank}.jsonl"
        if not path.exists():
            return []
        return [(d["it"], d["loss"]) for d in map(json.loads, path.read_text().splitlines())]

    def fsck(self) -> dict[str, Any]:
        return json.loads((self.dir / "fsck.json").read_text())  # type: ignore[no-any-return]

    def final(self, rank: int, name: str = "final") -> Checkpoint:
        async def read() -> Checkpoint:
            async with AsymStore([LocalTier(self.dir / f"{name}-rank{rank}")], keep_last=None,
                                 segment_bytes=4 << 20, compression="never") as store:
                return await store.restore()

        return asyncio.run(read())


def assert_same_state(a: Checkpoint, b: Checkpoint, *, ignore_meta: tuple[str, ...] = (),
                      ignore_tensors: str | None = None) -> None:
    """Every tensor bit-identical (dtype, shape, bytes) and the JSON meta equal (but for ``ignore_meta`` paths
    and tensors whose name starts with ``ignore_tensors``)."""
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, x in a.tensors.items():
        if ignore_tensors is not None and name.startswith(ignore_tensors):
            continue
        y = b.tensors[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name
    ma, mb = json.loads(json.dumps(a.meta)), json.loads(json.dumps(b.meta))
    for path in ignore_meta:
        *parents, leaf = path.split("/")
        for m in (ma, mb):
            for p in parents:
                m = m[p]
            m.pop(leaf)
    assert ma == mb


class Script:
    """``world`` ranks of tests/procs/peer_exit_script.py, each a Python process of its own (as torchrun starts them).

    Each rank's stdout and stderr go to ``out/log-rankR``; :meth:`wait` records when each process ended.
    """

    def __init__(self, case: dict[str, Any], out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.case = {**case, "out": str(out), "port": case.get("port") or free_ports(1)[0]}
        self.out = out
        spec = out / "case.json"
        spec.write_text(json.dumps(self.case))
        env = proc_env(OMP_NUM_THREADS="1")
        self.procs = []
        for r in range(self.case["world"]):
            with open(out / f"log-rank{r}", "w") as log:
                self.procs.append(subprocess.Popen(proc_argv("peer_exit_script", str(spec), str(r)),
                                                   stdout=log, stderr=subprocess.STDOUT, env=env))
        self.exited: dict[int, float] = {}

    def iterations(self, rank: int) -> int:
        path = self.out / f"progress-rank{rank}.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def wait_for_iterations(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while min(self.iterations(r) for r in range(len(self.procs))) < n:
            assert all(p.poll() is None for p in self.procs), [p.poll() for p in self.procs]
            assert time.monotonic() < deadline, f"not every rank reached iteration {n} in {timeout} s"
            time.sleep(0.05)

    def wait(self, ranks: list[int], timeout: float) -> None:
        """Wait up to ``timeout`` for ``ranks`` to end, noting when each did (wall clock)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(r not in self.exited for r in ranks):
            for r in ranks:
                if r not in self.exited and self.procs[r].poll() is not None:
                    self.exited[r] = time.time()
            time.sleep(0.02)

    def ended(self, rank: int) -> dict[str, Any] | None:
        """When (wall clock, ``t``) and how (``error``) the rank's training program ended, if it did."""
        path = self.out / f"ended-rank{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None  # type: ignore[no-any-return]

    def log(self, rank: int) -> str:
        return (self.out / f"log-rank{rank}").read_text()

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
