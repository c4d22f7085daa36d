"""Multi-rank checkpoints: per-rank shards plus a global manifest published only when every rank committed.

::

    from asymstore.multirank import RankStore

    store = RankStore("ckpt")                 # rank and world size from RANK / WORLD_SIZE
    async with store:
        await store.put_many(step, shard)     # this rank's tensors
        await store.commit(step)              # rank 0 publishes global/v…step.json once all ranks did
        ckpt = await store.restore()          # collective: the newest global version every rank can load

Names are imported on first use, so fsck can read the layout without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asymstore.errors import (
    CoordinationTimeoutError,
    GlobalCommitError,
    GlobalCommitTimeoutError,
    GlobalManifestError,
    GlobalVersionDroppedError,
    WorldSizeMismatchError,
)
from asymstore.runtime.lazy import lazy_getattr

if TYPE_CHECKING:
    from asymstore.dist.kv import KV, MemoryStore, store_from_env
    from asymstore.format.globalmanifest import GlobalManifest, ShardInfo, shard_digest
    from asymstore.format.names import rank_dirname
    from asymstore.multirank.globaldir import is_multirank
    from asymstore.multirank.store import RankStore

_LAZY = {
    "KV": "asymstore.dist.kv",
    "GlobalManifest": "asymstore.format.globalmanifest",
    "MemoryStore": "asymstore.dist.kv",
    "RankStore": "asymstore.multirank.store",
    "ShardInfo": "asymstore.format.globalmanifest",
    "is_multirank": "asymstore.multirank.globaldir",
    "rank_dirname": "asymstore.format.names",
    "shard_digest": "asymstore.format.globalmanifest",
    "store_from_env": "asymstore.dist.kv",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "KV",
    "CoordinationTimeoutError",
    "GlobalCommitError",
    "GlobalCommitTimeoutError",
    "GlobalManifest",
    "GlobalManifestError",
    "GlobalVersionDroppedError",
    "MemoryStore",
    "RankStore",
    "ShardInfo",
    "WorldSizeMismatchError",
    "is_multirank",
    "rank_dirname",
    "shard_digest",
    "store_from_env",
]
