"""Runs the hostile-file cases of tests/support/hostile_cases.py in this one process (a child of the test).

``python -m tests.procs.hostile_child OUT_JSON [CASE ...]`` runs every case
(or those named) and records, per case: what restore returned, the typed
error of ``restore(step=20)``, the fsck --deep verdict, the seconds taken and
the peak resident memory growth.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asymstore import AsymStore, AsymstoreError, LocalTier
from asymstore.fsck import check
from tests.support.hostile_cases import CASE_TIMEOUT_S, CASES, STEPS, state


async def _populate(root: Path) -> None:
    async with AsymStore([LocalTier(root)], keep_last=None, segment_bytes=1 << 20, compression="never") as store:
        for step in STEPS:
            await store.put_many(step, state(step))
            await store.commit(step)


async def _restore(root: Path, step: int | None = None) -> tuple[int, list[str], bool]:
    async with AsymStore([LocalTier(root)], segment_bytes=1 << 20, compression="never") as store:
        ckpt = await store.restore(step)
    same = all(torch.equal(ckpt.tensors[k], v) for k, v in state(ckpt.step).items())
    return ckpt.step, ckpt.fallbacks, same and ckpt.tensors.keys() == state(ckpt.step).keys()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def run_case(name: str, base: Path) -> dict[str, Any]:
    root = base / name
    await _populate(root)
    CASES[name](root)
    peak = _peak_rss()
    started = time.monotonic()
    out: dict[str, Any] = {}
    try:
        step, fallbacks, same = await asyncio.wait_for(_restore(root), CASE_TIMEOUT_S)
        out.update(restored=step, fallbacks=fallbacks, same=same)
    except BaseException as exc:  # recorded: the test says which errors are acceptable
        out["restore_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        await asyncio.wait_for(_restore(root, 20), CASE_TIMEOUT_S)
        out["step20_error"] = None
    except AsymstoreError as exc:
        out["step20_error"] = type(exc).__name__
        out["step20_typed"] = True
    except BaseException as exc:
        out["step20_error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["step20_typed"] = False
    try:
        report = await asyncio.wait_for(asyncio.to_thread(check, str(root), deep=True), CASE_TIMEOUT_S)
        v20 = [e for e in report.entries if e.step == 20 and not e.name.startswith(".")]
        out.update(fsck_ok=report.ok, fsck_newest=report.newest_restorable,
                   fsck_v20=[(e.status, e.problems) for e in v20])
    except BaseException as exc:
        out["fsck_error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["seconds"] = time.monotonic() - started
    out["rss_growth"] = _peak_rss() - peak
    return out


async def main(out_path: str, names: list[str]) -> None:
    base = Path(tempfile.mkdtemp(prefix="hostile-"))
    results = {}
    try:
        for name in names or list(CASES):
            results[name] = await run_case(name, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    Path(out_path).write_text(json.dumps(results))
    os._exit(0)  # a thread blocked on a special file must not keep the process alive


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
