"""The library never draws from the training loop's global RNGs: their state is part of every checkpoint.

A retry's jitter drawn from the global ``random`` module on the store's thread changed the loop's
Python RNG behind its back (a resumed run would not match an uninterrupted one): both retry paths,
the background cascade's and the remote tier's, use a private generator.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from asymstore import AsymStore, host_tier
from asymstore.testing import FailingLocalTier
from asymstore.tiers.remote.retry import RetryPolicy


async def test_remote_retries_leave_the_global_random_state_alone() -> None:
    random.seed(1234)
    before = random.getstate()
    calls = 0

    def flaky() -> int:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionResetError("transient")
        return 7

    assert await RetryPolicy(attempts=5, initial_s=0.001, max_backoff_s=0.002).run("read", flaky) == 7
    assert calls == 3 and random.getstate() == before


async def test_background_retries_leave_the_global_random_state_alone(tmp_path: Path) -> None:
    random.seed(99)
    before = random.getstate()
    disk = FailingLocalTier(tmp_path / "disk", fail_at="segments_written", times=2)
    memory = host_tier(16 << 20)
    async with AsymStore([memory, disk], keep_last=2, durable=memory) as store:  # the disk is a background tier
        await store.put(1, "w", torch.ones(16))
        await store.commit(1)
        await store.flushed(1, timeout=60)
        assert store.status()[disk.name].retries >= 1  # the background tier really retried
    assert random.getstate() == before
