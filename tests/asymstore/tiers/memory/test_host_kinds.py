"""host_tier() constructs the memory tier or the shared-memory-file tier, both BoundedTier instances."""

from __future__ import annotations

from pathlib import Path

import pytest

from asymstore import GPUTier, host_tier
from asymstore.tiers import BoundedTier
from asymstore.tiers.memory.process import MemoryTier
from asymstore.tiers.memory.shm import ShmTier
from asymstore.tiers.protocol import ExclusiveTier, HoldingTier, ProbeableTier, ReadIntoTier, Tier


def test_path_chooses_the_kind(tmp_path: Path) -> None:
    memory = host_tier(1 << 20, pin=False)
    files = host_tier(1 << 20, path=tmp_path / "shm", policy="skip")
    gpu = GPUTier(1 << 20, device="cpu")
    assert type(memory) is MemoryTier and memory.path is None and memory.name == "host:memory"
    assert type(files) is ShmTier and files.path == str(tmp_path / "shm") and files.policy == "skip"
    for tier in (memory, files, gpu):
        assert isinstance(tier, BoundedTier) and isinstance(tier, Tier)
        assert isinstance(tier, HoldingTier) and isinstance(tier, ReadIntoTier) and isinstance(tier, ProbeableTier)
    assert isinstance(files, ExclusiveTier)  # one writer per shared-memory directory
    assert not isinstance(memory, ExclusiveTier)  # nothing to lock in process memory
    assert repr(memory) == "host_tier('memory', capacity_bytes=1048576)"
    assert repr(files) == f"host_tier({str(tmp_path / 'shm')!r}, capacity_bytes=1048576)"


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        host_tier(0)
    with pytest.raises(ValueError, match="policy"):
        host_tier(1 << 20, path=tmp_path, policy="drop")
    with pytest.raises(TypeError, match="abstract"):
        BoundedTier(1 << 20)  # type: ignore[abstract]  # the capacity base holds no bytes of its own


async def test_both_kinds_share_the_accounting(tmp_path: Path) -> None:
    for tier in (host_tier(3000, pin=False), host_tier(3000, path=tmp_path / "shm")):
        await tier.open()
        for step in (1, 2):
            writer = await tier.begin(step, 1500)
            await writer.write_segment("seg-000000.bin", [b"x" * 1000])
            await writer.publish(b"{}")
        tier.hold(1)
        writer = await tier.begin(3, 1500)  # evicts 2, the oldest unheld
        assert await tier.list_versions() == [1] and tier.used_bytes <= tier.capacity_bytes
        await writer.abort()
        await tier.release(1)
        assert tier.used_bytes <= 1500 and tier.high_water_bytes <= tier.capacity_bytes
        await tier.close()


def test_the_old_class_like_name_still_builds_the_tier_and_warns(tmp_path: Path) -> None:
    import asymstore

    with pytest.warns(DeprecationWarning, match="use asymstore.host_tier"):
        old = asymstore.HostTier(1 << 20, path=tmp_path / "shm")
    assert type(old) is ShmTier and old.capacity_bytes == 1 << 20
