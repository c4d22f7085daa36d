"""CheckpointStore.read_manifest: a version's manifest without reading its tensors, skipping one that does not read."""

from __future__ import annotations

import os

import pytest
import torch

from asymstore import AsymStore, LocalTier
from asymstore.errors import NoCheckpointError, VersionNotFoundError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import version_dirname

FAST = {"compression": "never", "segment_bytes": 256 << 10}


async def test_read_manifest_gives_the_newest_readable_manifest_and_reads_no_tensor(tmp_path: object) -> None:
    root = os.path.join(str(tmp_path), "a")
    async with AsymStore([LocalTier(root)], **FAST) as store:  # type: ignore[arg-type]
        with pytest.raises(NoCheckpointError):
            await store.read_manifest()
        for step in (1, 2, 3):
            await store.put_many(step, {"w": torch.full((1000,), float(step))})
            await store.commit(step, {"user": {"step": step}})
    # step 3's segments are gone: a restore would fall back, the manifest still reads (no tensor is read)
    vdir3 = os.path.join(root, version_dirname(3))
    for name in os.listdir(vdir3):
        if name != MANIFEST_NAME:
            os.remove(os.path.join(vdir3, name))
    async with AsymStore([LocalTier(root)], **FAST) as store:  # type: ignore[arg-type]
        manifest = await store.read_manifest()
        assert manifest.step == 3 and manifest.meta["user"] == {"step": 3}
        assert (await store.read_manifest(1)).meta["user"] == {"step": 1}
        with pytest.raises(VersionNotFoundError):
            await store.read_manifest(7)
    # step 3's manifest is damaged: the previous version's is given
    with open(os.path.join(vdir3, MANIFEST_NAME), "r+b") as f:
        f.write(b"garbage")
    async with AsymStore([LocalTier(root)], **FAST) as store:  # type: ignore[arg-type]
        manifest = await store.read_manifest()
        assert manifest.step == 2 and manifest.meta["user"] == {"step": 2}
