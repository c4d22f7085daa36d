"""Child process for the crash and shared-memory tests, and the helpers both sides share.

Run as ``python tests/_store_child.py MODE ...``:

- ``crash ROOT PHASE AFTER NSTEPS COMPRESSION``: commit steps ``step_of(0..NSTEPS-1)``
  to a ``CrashingLocalTier`` (keep_last=2) that SIGKILLs the process at PHASE.
- ``loop ROOT``: commit steps to a ``LocalTier`` (keep_last=2) until killed.
- ``shm PATH NSTEPS CAPACITY``: commit NSTEPS steps to ``HostTier(path=PATH)``,
  then SIGKILL itself.

Every mode prints ``committed STEP`` (flushed) once ``commit`` has returned.
The tensors of a step are a pure function of the step (``make_state``), so
the parent can check a restore bit-exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from typing import Any

import torch

from asymstore import AsymStore, HostTier, LocalTier
from asymstore.fsck.__main__ import main as fsck_main
from asymstore.testing import CrashingLocalTier

SEGMENT_BYTES = 4096  # a version is ~8 KiB: two segments
CHILD = os.path.abspath(__file__)


def store_kw(compression: str = "never") -> dict[str, Any]:
    """AsymStore options of these tests: fixed small segments, so no calibration probe runs."""
    return {"segment_bytes": SEGMENT_BYTES, "compression": compression}


def step_of(i: int) -> int:
    """The step number of the i-th commit (not contiguous on purpose)."""
    return 10 * (i + 1)


def make_state(step: int, salt: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * salt + step)
    return {
        "w": torch.randn(48, 40, generator=g),
        "b": torch.randn(40, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (17,), generator=g),
        "mask": torch.rand(23, generator=g) > 0.5,
        "step": torch.tensor(step),
    }


def same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """True when both hold the same names with bit-identical dtype, shape and bytes."""
    if got.keys() != want.keys():
        return False
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            return False
        if not torch.equal(g.contiguous().view(-1).view(torch.uint8), w.contiguous().view(-1).view(torch.uint8)):
            return False
    return True


def fsck(*args: str) -> tuple[int, str]:
    """Run the fsck CLI (``python -m asymstore.fsck ARGS``) in this process; return (exit status, stdout).

    Same ``main`` as the ``python -m`` entry point, without paying for a fresh
    interpreter (importing torch) on every call; test_fsck_cli.py checks the
    real entry points agree with it.
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fsck_main(list(args))
    return rc, out.getvalue()


def fsck_json(*args: str) -> tuple[int, dict[str, Any]]:
    """Run ``fsck --json ARGS``; return (exit status, parsed report)."""
    rc, out = fsck("--json", *args)
    return rc, json.loads(out)


def fsck_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m asymstore.fsck ARGS`` as a real child process."""
    return subprocess.run([sys.executable, "-m", "asymstore.fsck", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def statuses(report: dict[str, Any]) -> dict[str, str]:
    """Entry name -> status of an fsck --json report."""
    return {v["name"]: v["status"] for v in report["versions"]}


def spawn(*args: str) -> subprocess.Popen[str]:
    """Start this script as a child process with ``args`` (stdin, stdout and stderr piped)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def committed_steps(stdout: str) -> list[int]:
    """The steps a child reported as committed."""
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("committed ")]


async def _commit_all(store: AsymStore, nsteps: int) -> None:
    for i in range(nsteps):
        step = step_of(i)
        await store.put_many(step, make_state(step))
        await store.commit(step, meta={"step": step})
        print(f"committed {step}", flush=True)


async def _main(argv: list[str]) -> None:
    mode, root = argv[0], argv[1]
    if mode == "crash":
        phase, after, nsteps, compression = argv[2], int(argv[3]), int(argv[4]), argv[5]
        tier = CrashingLocalTier(root, crash_at=phase, after=after)  # type: ignore[arg-type]
        async with AsymStore([tier], keep_last=2, **store_kw(compression)) as store:
            await _commit_all(store, nsteps)
    elif mode == "loop":
        async with AsymStore([LocalTier(root)], keep_last=2, **store_kw()) as store:
            print("ready", flush=True)
            sys.stdin.readline()  # the parent says when to start
            await _commit_all(store, 1_000_000)
    elif mode == "shm":
        nsteps, capacity = int(argv[2]), int(argv[3])
        store = AsymStore([HostTier(capacity, path=root)], keep_last=None, **store_kw())
        await store.open()
        await _commit_all(store, nsteps)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1:]))
