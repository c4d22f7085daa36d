"""DCP storage: ``torch.distributed.checkpoint`` saves and loads asymstore versions.

::

    import torch.distributed.checkpoint as dcp
    from asymstore.dcp import StorageReader, StorageWriter

    writer = StorageWriter("ckpt")                    # a directory, tiers, an AsymStore or a RankStore
    dcp.save(state_dict, storage_writer=writer)       # or dcp.async_save(...): one version per save
    dcp.load(state_dict, storage_reader=StorageReader(writer))   # the newest version that verifies

:class:`StorageWriter` implements DCP's ``StorageWriter`` (``dcp.save``,
``dcp.async_save``), :class:`StorageReader` its ``StorageReader`` (``dcp.load``,
with DCP's own resharding across numbers of ranks). Each save is one
asymstore version on every tier of the store (manifests, chunk checksums,
atomic publish, retention, the background cascade), or under several ranks one
shard per rank plus a global manifest published once every shard is committed
(:class:`~asymstore.multirank.RankStore`); ``python -m asymstore.fsck`` checks
the result like any other version. DCP's metadata is stored as strict JSON,
not pickled (:mod:`asymstore.dcp.metadata` says what is stored and the one
opt-in exception). The call order of DCP and what each call does here:
:mod:`asymstore.dcp.writer`, :mod:`asymstore.dcp.reader`. Guide:
``docs/guides/dcp.md``.
"""

from __future__ import annotations

from asymstore.dcp.reader import StorageReader
from asymstore.dcp.spec import StoreSpec, parse_step
from asymstore.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter", "StoreSpec", "parse_step"]
