"""DCP storage: ``torch.distributed.checkpoint`` saves and loads asymstore versions.

::

    writer = StorageWriter("ckpt")                    # a directory, tiers, an AsymStore or a RankStore
    dcp.save(state_dict, storage_writer=writer)       # or dcp.async_save(...): one version per save
    dcp.load(state_dict, storage_reader=StorageReader(writer))   # the newest version that verifies

Each save is one asymstore version (one shard per rank and a global manifest under several ranks);
DCP's metadata is stored as strict JSON (:mod:`asymstore.dcp.metadata`); loading reshards with DCP's
own planner. Guide: ``docs/guides/dcp.md``.
"""

from __future__ import annotations

from asymstore.dcp.reader import StorageReader
from asymstore.dcp.spec import StoreSpec, parse_step
from asymstore.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter", "StoreSpec", "parse_step"]
