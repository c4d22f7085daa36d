"""Shards of ranks that left: after a job resumes on fewer ranks, the coordinator retires what they left behind.

Ranks ``>= world_size`` of a job that shrank (a version written by N ranks,
resharded onto M < N) have no store of their own to apply retention to their
directories. After each global commit the coordinator takes each such rank's
tiers (their writer lock, so a live writer is never touched), deletes the
shards no kept global version needs, and points ``LATEST`` at what is left
(or removes it from a rank directory left empty).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from asymstore.errors import AsymstoreError
from asymstore.format.globalmanifest import GlobalManifest
from asymstore.format.names import LATEST, rank_dirname
from asymstore.io.files import fsync_dir
from asymstore.multirank import globaldir
from asymstore.tiers.protocol import ExclusiveTier, Tier

logger = logging.getLogger(__name__)


def _drop_latest(rank_dir: str) -> None:
    """Remove the ``LATEST`` hint of a rank directory that holds no version any more (the default layout)."""
    try:
        os.unlink(os.path.join(rank_dir, LATEST))
    except FileNotFoundError:
        return
    fsync_dir(rank_dir)


async def retire_departed(root: str, world_size: int, kept: Sequence[GlobalManifest],
                          tiers_of: Callable[[int], Sequence[Tier]]) -> list[str]:
    """Delete shards of ranks ``>= world_size`` that no global version in ``kept`` uses.

    Args:
        root: the multi-rank root (its ``rank-NNNNN`` directories are listed).
        world_size: the job's number of ranks.
        kept: the global versions retention keeps.
        tiers_of: unopened tiers of a rank's shards.

    Returns:
        One line per shard deleted (a rank whose tiers cannot be locked or read is logged and skipped).
    """
    done: list[str] = []
    for rank in [r for r in globaldir.rank_dirs(root) if r >= world_size]:
        needed = {g.shard(rank).step for g in kept if rank < g.world_size}
        for tier in tiers_of(rank):
            locked = False
            try:
                await tier.open()
                if isinstance(tier, ExclusiveTier):
                    await tier.lock_root()
                    locked = True
                steps = await tier.list_versions()
                for step in [s for s in steps if s not in needed]:
                    await tier.delete_version(step)
                    done.append(f"rank {rank} shard {step} on {tier.name}")
                left = [s for s in steps if s in needed]
                if left and len(left) < len(steps):
                    await tier.write_latest(max(left))
                elif not left and steps:  # nothing left: LATEST must not name a shard that is gone
                    _drop_latest(os.path.join(root, rank_dirname(rank)))
            except (AsymstoreError, OSError) as exc:
                logger.info("shards of departed rank %d on %s left as they are: %s", rank, tier.name, exc)
            finally:
                if locked:
                    assert isinstance(tier, ExclusiveTier)
                    await tier.unlock_root()
                await tier.close()
    if done:
        logger.info("retired %d shard(s) of rank(s) no longer in the job: %s", len(done), "; ".join(done[:8]))
    return done
