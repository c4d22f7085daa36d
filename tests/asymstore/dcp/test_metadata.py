"""DCP's metadata as strict JSON (asymstore.dcp.metadata): a round trip of every kind of entry, and malformed
documents refused with a typed error before anything of them is used. One save at a time per writer: a save
that a newer one overtook can neither stage nor commit (no version mixes two saves). Ranks that chose different
versions to load read nothing, and every rank skips the newer at the next load.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from asymstore.dcp import StorageReader, StorageWriter
from asymstore.dcp import metadata as md
from asymstore.errors import DCPMetadataError, DCPStorageError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def sample() -> Metadata:
    size = torch.Size([4, 6])
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
              ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6]))]
    return Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16, requires_grad=True), size, chunks),
            "model.s": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([]),
                                             [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]),
            "optim.param_groups.0.lr": BytesStorageMetadata()},
        planner_data={"model.w": ("model", "w"), "model.s": ("model", "s"),
                      "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr")},
        storage_data={MetadataIndex("model.w", [0, 0]): md.ItemLocation(0, "model.w@0_0"),
                      MetadataIndex("model.w", [2, 0]): md.ItemLocation(1, "model.w@2_0"),
                      MetadataIndex("model.s", []): md.ItemLocation(0, "model.s"),
                      MetadataIndex("optim.param_groups.0.lr"): md.ItemLocation(1, "optim.param_groups.0.lr")},
        storage_meta=StorageMeta(checkpoint_id="3", save_id="abc"), version="1.0.0")


def test_round_trip() -> None:
    doc, pickled = md.encode(sample())
    assert pickled is None
    json.loads(doc)  # strict JSON
    back = md.decode(doc, world_size=2)
    want = sample()
    assert back.state_dict_metadata == want.state_dict_metadata
    assert back.planner_data == want.planner_data and back.storage_data == want.storage_data
    assert back.version == "1.0.0" and back.storage_meta is not None and back.storage_meta.save_id == "abc"


def mutate(doc: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


BAD = {
    "format": (["format"], 2),
    "dtype": (["state_dict_metadata", "model.w", "dtype"], "float33"),
    "dtype-not-a-dtype": (["state_dict_metadata", "model.w", "dtype"], "Tensor"),
    "dtype-dunder": (["state_dict_metadata", "model.w", "dtype"], "__class__"),
    "size": (["state_dict_metadata", "model.w", "size"], [-1, 6]),
    "size-type": (["state_dict_metadata", "model.w", "size"], "4,6"),
    "chunk-outside": (["state_dict_metadata", "model.w", "chunks", 1, 0], [3, 0]),
    "chunk-dims": (["state_dict_metadata", "model.w", "chunks", 0, 1], [2]),
    "requires_grad": (["state_dict_metadata", "model.w", "requires_grad"], "yes"),
    "entry-type": (["state_dict_metadata", "model.s", "type"], "pickle"),
    "item-rank": (["items", 0, 2], 2),
    "item-rank-bool": (["items", 0, 2], True),
    "item-fqn": (["items", 0, 0], "model.nope"),
    "item-name": (["items", 0, 3], ""),
    "item-shape": (["items", 0], ["model.w", [0, 0], 0]),
    "planner-kind": (["planner_data", "kind"], "eval"),
    "planner-path": (["planner_data", "mappings", "model.w"], ["model", -1]),
    "planner-pickled-unread": (["planner_data"], {"kind": "pickle", "tensor": md.PLANNER_NAME}),
    "storage_meta": (["storage_meta", "modules"], [1]),
    "items-missing": (["items"], KeyError),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_documents_are_refused(case: str) -> None:
    good = json.loads(md.encode(sample())[0])
    path, value = BAD[case]
    with pytest.raises(DCPMetadataError):
        md.decode(json.dumps(mutate(good, path, value)).encode(), world_size=2)


@pytest.mark.parametrize("raw", [b"", b"[]", b"{", b'{"format": 1, "x": NaN}', b"[" * 100000, b"\xff\xfe"])
def test_not_json_is_refused(raw: bytes) -> None:
    with pytest.raises(DCPMetadataError):
        md.decode(raw, world_size=1)


def test_a_save_overtaken_by_a_newer_one_never_commits(tmp_path: Path) -> None:
    old = {"w": torch.zeros(8), "tag": "old"}
    writer = StorageWriter(tmp_path / "ckpt")
    planner = DefaultSavePlanner()  # the first save, driven by hand up to its write_data: it stops before finish
    planner.set_up_planner(old, writer.storage_meta(), True)
    writer.set_up_storage_writer(True, rank=0)
    plans, metadata = planner.create_global_plan([writer.prepare_local_plan(planner.create_local_plan())])
    plans = writer.prepare_global_plan(plans)
    results = writer.write_data(planner.finish_plan(plans[0]), planner).value()

    new = {"w": torch.ones(8), "tag": "new"}
    dcp.save(new, storage_writer=writer)  # a newer save begins (and ends) meanwhile
    assert writer.last_step == 1  # step 0 stays the overtaken save's: never reused
    with pytest.raises(DCPStorageError, match="one save at a time"):
        writer.finish(metadata, [results])
    assert writer.store.versions()[writer.store.tiers[0].name] == [1]
    writer.close()
    back = {"w": torch.full((8,), 5.0), "tag": ""}
    with StorageReader(tmp_path / "ckpt") as reader:
        dcp.load(back, storage_reader=reader)
    assert back["tag"] == "new" and torch.equal(back["w"], new["w"])


def test_ranks_that_chose_different_versions_skip_the_newer_at_the_next_load(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.planner import LoadPlan

    with StorageWriter(tmp_path / "ckpt") as writer:
        for n in range(3):
            dcp.save({"w": torch.full((4,), float(n))}, storage_writer=writer)
    coordinator, other = StorageReader(tmp_path / "ckpt"), StorageReader(tmp_path / "ckpt")
    other.bad_steps.add(2)  # as if this rank had found step 2 corrupt in an earlier load
    plans = []
    for reader in (coordinator, other):
        reader.read_metadata()
        reader.set_up_storage_reader(reader._metadata, reader is coordinator, rank=0)  # type: ignore[arg-type]
        plans.append(reader.prepare_local_plan(LoadPlan([])))
    assert [p.storage_data.step for p in plans] == [2, 1]
    for reader, plan in zip((coordinator, other), coordinator.prepare_global_plan(plans), strict=True):
        with pytest.raises(DCPStorageError, match="different versions"):
            reader.read_data(plan, None)  # type: ignore[arg-type]
        assert reader.bad_steps == {2}
    back = {"w": torch.zeros(4)}
    dcp.load(back, storage_reader=coordinator)  # the next load agrees on step 1
    assert coordinator.step == 1 and torch.equal(back["w"], torch.full((4,), 1.0))
    coordinator.close()
    other.close()
