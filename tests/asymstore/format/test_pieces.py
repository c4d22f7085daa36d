"""Global tensor metadata (asymstore.format.pieces): torch.chunk pieces, strict JSON, hostile layouts refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from asymstore.errors import LayoutError
from asymstore.format.manifest import Manifest, TensorEntry
from asymstore.format.pieces import (
    MeshInfo,
    TensorLayout,
    chunk_piece,
    layout_meta,
    parse_layout_meta,
    read_layouts,
)


@pytest.mark.parametrize("size", [0, 1, 2, 3, 7, 8, 9])
@pytest.mark.parametrize("pieces", [1, 2, 3, 4])
def test_chunk_piece_matches_torch_chunk_and_tiles_the_dimension(size: int, pieces: int) -> None:
    chunks = torch.arange(size).chunk(pieces) if size else ()
    covered = []
    for i in range(pieces):
        offset, length = chunk_piece(size, pieces, i)
        if i < len(chunks):
            assert chunks[i].tolist() == list(range(offset, offset + length))
        else:  # torch.chunk returns fewer pieces: the rest are empty, placed at the end
            assert length == 0 and offset == size
        covered += list(range(offset, offset + length))
    assert covered == list(range(size))


def mesh(n: int, rank: int) -> MeshInfo:
    return MeshInfo((n,), tuple(range(n)), (rank,))


def test_fsdp2_uneven_shard_records_the_real_extent() -> None:
    pieces = [TensorLayout.sharded((7, 5), "float32", mesh(2, r), ["S(0)"]) for r in range(2)]
    assert [(p.offsets, p.shape) for p in pieces] == [((0, 0), (4, 5)), ((4, 0), (3, 5))]
    empty = TensorLayout.sharded((1, 7), "float32", mesh(2, 1), ["S(0)"])
    assert empty.offsets == (1, 0) and empty.shape == (0, 7)
    hsdp = TensorLayout.sharded((10,), "bfloat16", MeshInfo((2, 3), (0, 1, 2, 3, 4, 5), (1, 2)), ["R", "S(0)"])
    assert hsdp.offsets == (8,) and hsdp.shape == (2,)
    nested = TensorLayout.sharded((9, 4), "float32", MeshInfo((2, 2), (0, 1, 2, 3), (1, 1)), ["S(0)", "S(1)"])
    assert nested.offsets == (5, 2) and nested.shape == (4, 2)


def test_json_round_trip_is_strict_and_whole_tensors_are_replicated_layout() -> None:
    layouts = {"model/w": TensorLayout.sharded((7, 5), "float32", mesh(2, 1), ["S(0)"]),
               "rng/torch": TensorLayout.whole((16,), "uint8")}
    doc = json.loads(json.dumps(layout_meta(layouts), allow_nan=False))
    assert doc["default"] == "whole" and list(doc["tensors"]) == ["model/w"]  # whole tensors: the default
    assert parse_layout_meta(doc) == {"model/w": layouts["model/w"]}
    got = read_layouts(manifest({"layout": doc}, **{"model/w": ("float32", (3, 5)), "rng/torch": ("uint8", (16,))}))
    assert got == layouts
    for layout in layouts.values():
        assert TensorLayout.from_json(layout.to_json()) == layout  # the self-contained form: mesh inline


def test_each_mesh_is_listed_once() -> None:
    layouts = {f"w{i}": TensorLayout.sharded((9, 2), "float32", mesh(4, 3), ["S(0)"]) for i in range(50)}
    doc = layout_meta(layouts)
    assert len(doc["meshes"]) == 1 and {e["mesh"] for e in doc["tensors"].values()} == {0}
    assert parse_layout_meta(doc) == layouts
    for bad in (5, -1, True, "0"):
        broken = json.loads(json.dumps(doc))
        broken["tensors"]["w3"]["mesh"] = bad
        with pytest.raises(LayoutError, match="w3"):
            parse_layout_meta(broken)
    with pytest.raises(LayoutError):
        parse_layout_meta({**doc, "meshes": [doc["meshes"][0]] * 2000})
    with pytest.raises(LayoutError):
        parse_layout_meta({**doc, "meshes": {"0": doc["meshes"][0]}})


def good() -> dict[str, Any]:
    return TensorLayout.sharded((7, 5), "float32", mesh(2, 1), ["S(0)"]).to_json()


@pytest.mark.parametrize("edit", [
    lambda d: d.update(offsets=[3, 0]),  # not the piece S(0) gives coordinate 1
    lambda d: d.update(shape=[4, 5]),
    lambda d: d.update(global_shape=[7, -5]),
    lambda d: d.update(global_shape=[7, True]),
    lambda d: d.update(global_shape=[7.0, 5]),
    lambda d: d.update(offsets=[4]),
    lambda d: d.update(dtype="float128"),
    lambda d: d.update(placements=["P(sum)"]),
    lambda d: d.update(placements=["S(2)"]),
    lambda d: d.update(placements=["S(0)", "R"]),
    lambda d: d.update(placements="S(0)"),
    lambda d: d["mesh"].update(coordinate=[2]),
    lambda d: d["mesh"].update(ranks=[0, 0]),
    lambda d: d["mesh"].update(ranks=[0, 1, 2]),
    lambda d: d["mesh"].update(shape=[]),
    lambda d: d.update(mesh=[2]),
    lambda d: d.update(mesh=None),  # a piece without a mesh
    lambda d: d.update(global_shape=list(range(1, 70)), offsets=[0] * 69, shape=list(range(1, 70))),
])
def test_hostile_layouts_are_refused_with_a_typed_error(edit: Any) -> None:
    doc = good()
    edit(doc)
    with pytest.raises(LayoutError):
        TensorLayout.from_json(doc)


def manifest(meta: dict[str, Any], **tensors: tuple[str, tuple[int, ...]]) -> Manifest:
    return Manifest(1, {name: TensorEntry(dtype, shape, 0, ()) for name, (dtype, shape) in tensors.items()},
                    (), meta)


def test_read_layouts_checks_the_manifest_and_defaults_to_whole() -> None:
    meta = {"layout": layout_meta({"w": TensorLayout.sharded((7, 5), "float32", mesh(2, 1), ["S(0)"])})}
    got = read_layouts(manifest(meta, w=("float32", (3, 5)), b=("int64", (2,))))
    assert got["w"].global_shape == (7, 5) and got["b"] == TensorLayout.whole((2,), "int64")
    assert read_layouts(manifest({}, b=("int64", (2,))))["b"].is_whole  # a version from before layouts
    for bad in (manifest(meta, w=("float32", (4, 5))), manifest(meta, w=("bfloat16", (3, 5))),
                manifest(meta, v=("float32", (3, 5))), manifest({"layout": {"format": 2, "tensors": {}}}),
                manifest({"layout": {**meta["layout"], "default": "sharded"}}, w=("float32", (3, 5))),
                manifest({"layout": {"format": 1, "tensors": {"w": "x"}}}, w=("float32", (3, 5)))):
        with pytest.raises(LayoutError):
            read_layouts(bad)
