"""Driver of the multi-rank tests (run as a script, one per rank; never imported by pytest).

``python -m tests.procs.mr_driver --rank R --world W --cases CASES.json --out OUT``

Importing torch and DeepSpeed costs seconds per process, so each rank starts
one driver that imports them once and then runs every case of the list in a
forked child (a fresh process image for torch.distributed and DeepSpeed, and a
real process to SIGKILL). The drivers of all ranks walk the list in step:
before and after each case they meet at a file barrier under OUT. After a
case marked ``fsck``, rank 0's driver runs fsck on the case's checkpoint root
and writes the report to ``OUT/<case>/fsck.json`` (before anything resumes
from it). A child that outlives its case's deadline is SIGKILLed.

Each case (a JSON object) says what the child does; see tests/support/mr_cases.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def barrier(out: Path, name: str, rank: int, world: int, timeout: float = 600.0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-rank{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all((out / f"{name}-rank{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {out}/{name}")
        time.sleep(0.02)


def wait_child(pid: int, deadline_s: float) -> int:
    end = time.monotonic() + deadline_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return -1000  # killed by the driver: the case hung
        time.sleep(0.02)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cases: list[dict[str, Any]] = json.loads(Path(args.cases).read_text())
    out = Path(args.out)

    from tests.support import mr_cases  # imports torch (and DeepSpeed when a case needs it) once, before forking

    mr_cases.preload({c["kind"] for c in cases})
    for case in cases:
        cdir = out / case["name"]
        barrier(cdir, "start", args.rank, args.world)
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                mr_cases.run(case, args.rank, args.world, cdir)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        rc = wait_child(pid, float(case.get("deadline", 120)))
        (cdir / f"rc-rank{args.rank}.json").write_text(json.dumps({"rc": rc, "seconds": time.monotonic() - started}))
        barrier(cdir, "end", args.rank, args.world)
        if args.rank == 0 and case.get("fsck"):
            from asymstore.fsck import check

            (cdir / "fsck.json").write_text(json.dumps(check(case.get("fsck_dir", case["dir"])).to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
