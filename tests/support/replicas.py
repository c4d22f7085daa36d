"""Checks that a multi-rank root holds DDP's replicated state in slices (``CommitOptions(dedup="replicas")``).

Used by the integrations' DDP kill-and-resume tests (the Trainer, Accelerate, Lightning): the newest
global version's every shard carries the replicas claim (:mod:`asymstore.format.replicas`: mode
``"slices"``, the job's world size, one digest on every rank), and each shard's raw bytes are about
``1 / world`` of one whole copy of the replicated state (whole copies: each shard at least all of it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from asymstore.format.globalmanifest import GlobalManifest
from asymstore.format.replicas import REPLICAS_KEY

__all__ = ["assert_sliced", "nbytes", "newest_global"]


def newest_global(root: Path) -> GlobalManifest:
    """The newest global manifest published under ``root``."""
    found = [GlobalManifest.from_json(p.read_bytes()) for p in (root / "global").glob("v*.json")]
    assert found, f"no global version under {root}"
    return max(found, key=lambda g: g.step)


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Raw bytes of ``tensors``, each storage counted once (tied weights once)."""
    seen: dict[tuple[object, int, int], int] = {}
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), int(t.numel()))
        seen[key] = t.numel() * t.element_size()
    return sum(seen.values())


def assert_sliced(root: Path, world: int, replicated: int, what: str = "") -> None:
    """The newest global version under ``root`` holds its replicated state in slices, ``world`` ranks.

    Args:
        root: the job's multi-rank root.
        world: its ranks.
        replicated: raw bytes of one whole copy of the replicated state (parameters and optimizer state).
        what: context for the assertion messages.
    """
    g = newest_global(root)
    assert g.world_size == world, what
    digests = set()
    for shard in g.shards:
        claim = shard.summary.get(REPLICAS_KEY)
        assert claim is not None, f"{what}: rank {shard.rank} of version {g.step} holds whole copies (no claim)"
        assert claim["mode"] == "slices" and claim["world"] == world, f"{what}: {claim}"
        digests.add(claim["digest"])
        # a whole copy is at least ``replicated`` bytes per shard; a slice about 1 / world of it, plus RNG and buffers
        ratio = shard.nbytes / replicated
        assert ratio <= 1 / world + 0.2, f"{what}: rank {shard.rank} wrote {ratio:.2f} of the replicated state"
    assert len(digests) == 1, f"{what}: the ranks' replicas differ: {digests}"
