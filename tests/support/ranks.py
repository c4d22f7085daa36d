"""Ranks as threads of one process, each with its own event loop, over a shared c10d store (multi-rank tests)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from asymstore.multirank import RankStore


def store(root: Path, rank: int, world: int, kv: Any, **kw: Any) -> RankStore:
    kw.setdefault("timeout_s", 3.0)
    kw.setdefault("restore_timeout_s", 10.0)
    return RankStore(root, rank=rank, world_size=world, kv=kv, segment_bytes=1 << 20, compression="never", **kw)


def run_ranks(world: int, fn: Callable[[int], Awaitable[Any]]) -> dict[int, Any]:
    """Run ``fn(rank)`` for every rank on its own thread and event loop; exceptions are returned as values."""
    out: dict[int, Any] = {}

    def body(rank: int) -> None:
        try:
            out[rank] = asyncio.run(fn(rank))  # type: ignore[arg-type]
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out
