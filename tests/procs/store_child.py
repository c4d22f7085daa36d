"""Child process of the crash and shared-memory tests (started by ``tests.support.store.spawn``).

Run as ``python -m tests.procs.store_child MODE ...``:

- ``crash ROOT PHASE AFTER NSTEPS COMPRESSION``: commit steps ``step_of(0..NSTEPS-1)``
  to a ``CrashingLocalTier`` (keep_last=2) that SIGKILLs the process at PHASE.
- ``frozen ROOT PHASE AFTER NSTEPS``: as ``crash``, with the frozen-base state of
  ``make_frozen_state`` (its base referenced from the first version, format 4).
- ``loop ROOT``: commit steps to a ``LocalTier`` (keep_last=2) until killed.
- ``shm PATH NSTEPS CAPACITY``: commit NSTEPS steps to ``host_tier(path=PATH)``,
  then SIGKILL itself.

Every mode prints ``committed STEP`` (flushed) once ``commit`` has returned.
The tensors of a step are ``make_state(step)`` (tests/support/store.py), so
the parent can check a restore bit-exact.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable

import torch

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.testing import CrashingLocalTier
from tests.support.store import make_frozen_state, make_state, step_of, store_kw


async def _commit_all(store: AsymStore, nsteps: int,
                      make: Callable[[int], dict[str, torch.Tensor]] = make_state) -> None:
    for i in range(nsteps):
        step = step_of(i)
        await store.put_many(step, make(step))
        await store.commit(step, meta={"step": step})
        print(f"committed {step}", flush=True)


async def _main(argv: list[str]) -> None:
    mode, root = argv[0], argv[1]
    if mode == "crash":
        phase, after, nsteps, compression = argv[2], int(argv[3]), int(argv[4]), argv[5]
        tier = CrashingLocalTier(root, crash_at=phase, after=after)  # type: ignore[arg-type]
        async with AsymStore([tier], keep_last=2, **store_kw(compression)) as store:
            await _commit_all(store, nsteps)
    elif mode == "frozen":
        phase, after, nsteps = argv[2], int(argv[3]), int(argv[4])
        tier = CrashingLocalTier(root, crash_at=phase, after=after)  # type: ignore[arg-type]
        async with AsymStore([tier], keep_last=2, **store_kw()) as store:
            await _commit_all(store, nsteps, make_frozen_state)
    elif mode == "loop":
        async with AsymStore([LocalTier(root)], keep_last=2, **store_kw()) as store:
            print("ready", flush=True)
            sys.stdin.readline()  # the parent says when to start
            await _commit_all(store, 1_000_000)
    elif mode == "shm":
        nsteps, capacity = int(argv[2]), int(argv[3])
        store = AsymStore([host_tier(capacity, path=root)], keep_last=None, **store_kw())
        await store.open()
        await _commit_all(store, nsteps)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1:]))
