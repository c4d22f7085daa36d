"""A corrupted segment of a DCP version: detected (a typed error, never a destination holding unverified bytes),
replaced by the previous version within a single-process load, skipped by the next load otherwise, and reported
by ``fsck``. A corrupted ``.dcp/metadata`` is skipped when the version is chosen.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asymstore import CorruptVersionError
from asymstore.dcp import StorageReader, StorageWriter
from asymstore.format.names import version_dirname
from tests.support import dcp_train as t

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state_of(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)},
            "optim": {"m": torch.randn(256, 64, generator=g)}, "step": seed}


def flip(root: Path, step: int, tensor: str) -> None:
    """Flip one byte in the middle of ``tensor``'s first chunk in ``step``'s segment file."""
    vdir = root / version_dirname(step)
    doc = json.loads((vdir / "MANIFEST.json").read_text())
    chunk = doc["tensors"][tensor]["chunks"][0]
    path = vdir / chunk["segment"]
    data = bytearray(path.read_bytes())
    data[chunk["offset"] + chunk["length"] // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_corrupt_segment_is_never_loaded(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with StorageWriter(root, compression="never", segment_bytes=1 << 20) as writer:
        dcp.save(state_of(10), storage_writer=writer)
        dcp.save(state_of(11), storage_writer=writer)
    flip(root, 1, "model.w")

    # exactly the corrupt step: a typed error, and the destination holds no unverified byte
    dest = state_of(99)
    before = dest["model"]["w"].clone()
    with StorageReader(root) as reader:
        with pytest.raises(CheckpointException) as info:
            dcp.load(dest, storage_reader=reader, checkpoint_id=1)
        assert isinstance(reader.error, CorruptVersionError) and "model.w" in str(reader.error)
        assert any(isinstance(f[0], CorruptVersionError) for f in info.value.failures.values())
        assert torch.equal(dest["model"]["w"], before)  # never a destination holding what did not verify
        assert reader.bad_steps == {1} and reader.steps() == [0]

    # the newest: the load goes on from step 0, every item of it
    dest = state_of(98)
    with StorageReader(root) as reader:
        dcp.load(dest, storage_reader=reader)
        assert reader.step == 0 and reader.bad_steps == {1}
        assert any("step 1" in line or "v000000000001" in line or "model.w" in line for line in reader.fallbacks)
    assert t.digests(dest) == t.digests(state_of(10))

    done = t.fsck(root, "--deep")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "corrupt" in done.stdout and "v000000000001" in done.stdout, done.stdout


def test_a_corrupt_metadata_tensor_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with StorageWriter(root, compression="never", segment_bytes=1 << 20) as writer:
        dcp.save(state_of(20), storage_writer=writer)
        dcp.save(state_of(21), storage_writer=writer)
    flip(root, 1, ".dcp/metadata")
    dest = state_of(97)
    with StorageReader(root) as reader:
        dcp.load(dest, storage_reader=reader)
        assert reader.step == 0
        assert any("step 1" in line for line in reader.fallbacks), reader.fallbacks
    assert t.digests(dest) == t.digests(state_of(20))
