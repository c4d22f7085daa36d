"""DCP's ``Metadata`` as strict JSON: what a DCP version stores besides its tensors, and how it is read back.

DCP's own ``FileSystemWriter`` pickles ``Metadata``; here it is one strict JSON document, the uint8
tensor ``.dcp/metadata`` of the coordinator's shard (checksummed and verified before it is parsed).
Planner data strict JSON cannot hold is refused (:class:`~asymstore.errors.DCPStorageError`) unless
the writer opts in with ``pickle_planner_data=True`` (the tensor ``.dcp/planner-data``, unpickled
only by a reader with ``allow_pickle=True``). Decoding treats the document as untrusted: every field
is type-checked and bounded, any deviation is a :class:`~asymstore.errors.DCPMetadataError`.

Guide (the document's fields, what is pickled): ``docs/guides/dcp.md``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from asymstore.errors import DCPMetadataError, DCPStorageError
from asymstore.format.manifest import MAX_DIMS

FORMAT = 1
"""Format of the JSON document (and of ``meta["dcp"]``)."""
META_KEY = "dcp"
"""Key of the manifest meta that marks a DCP shard: ``{"format", "rank", "world_size", "items"[, "metadata"]}``."""
METADATA_NAME = ".dcp/metadata"
"""The coordinator's tensor holding the JSON document."""
PLANNER_NAME = ".dcp/planner-data"
"""The coordinator's tensor holding pickled planner data (only with ``pickle_planner_data=True``)."""
MARKER_NAME = ".dcp/rank"
"""Every shard's int64 tensor ``[rank, world_size]`` (a rank that saves no item still commits a shard)."""
RESERVED_PREFIX = ".dcp/"

MAX_METADATA_BYTES = 1 << 30
"""Largest JSON document a reader parses."""


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved chunk (a ``WriteResult``'s ``storage_data``) is stored.

    Attributes:
        rank: the rank whose shard holds it.
        name: the stored tensor's name in that shard.
    """

    rank: int
    name: str


def dtype_to_json(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_json(name: object) -> torch.dtype:
    """The torch dtype a JSON name gives (any torch dtype, not only storable ones).

    Raises:
        DCPMetadataError: not the name of a torch dtype.
    """
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype) or dtype_to_json(value) != name:
        raise DCPMetadataError(f"unknown dtype {name!r} in DCP metadata")
    return value


# -- encoding ------------------------------------------------------------------


def _planner_data_json(data: object) -> Any:
    """The JSON form of DCP's flattening map (``dict[str, tuple[str | int, ...]]``), or None if it is not one."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise TypeError
    out = {}
    for key, path in data.items():
        if not isinstance(key, str) or not isinstance(path, (tuple, list)):
            raise TypeError
        for part in path:
            if isinstance(part, bool) or not isinstance(part, (str, int)):
                raise TypeError
        out[key] = list(path)
    return out


def encode(metadata: Metadata, *, pickle_planner_data: bool = False) -> tuple[bytes, bytes | None]:
    """Encode ``metadata`` (its ``storage_data`` maps ``MetadataIndex`` to :class:`ItemLocation`).

    Returns:
        The JSON document, and the pickled planner data when it had to be pickled (else None).

    Raises:
        DCPStorageError: planner data JSON cannot hold, without ``pickle_planner_data``;
            an entry of a kind DCP does not define.
    """
    state: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            props = entry.properties
            state[fqn] = {"type": "tensor", "dtype": dtype_to_json(props.dtype),
                          "requires_grad": bool(props.requires_grad), "size": list(entry.size),
                          "chunks": [[list(c.offsets), list(c.sizes)] for c in entry.chunks]}
        elif isinstance(entry, BytesStorageMetadata):
            state[fqn] = {"type": "bytes"}
        else:
            raise DCPStorageError(f"{fqn!r}: unknown DCP storage metadata {type(entry).__name__}")
    pickled: bytes | None = None
    try:
        planner: Any = {"kind": "flatten", "mappings": _planner_data_json(metadata.planner_data)}
    except TypeError:
        if not pickle_planner_data:
            raise DCPStorageError(
                f"the planner's data ({type(metadata.planner_data).__name__}) is not DCP's flattening map, "
                "and strict JSON cannot hold it; pass pickle_planner_data=True to StorageWriter to store it "
                "pickled (a reader then needs allow_pickle=True)") from None
        import pickle

        pickled = pickle.dumps(metadata.planner_data, protocol=pickle.HIGHEST_PROTOCOL)
        planner = {"kind": "pickle", "tensor": PLANNER_NAME}
    items = []
    for index, where in (metadata.storage_data or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(where, ItemLocation):
            raise DCPStorageError(f"storage data entry {index!r} was not written by asymstore.dcp")
        items.append([index.fqn, None if index.offset is None else list(index.offset), where.rank, where.name])
    sm = metadata.storage_meta
    storage_meta = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
        "save_id": sm.save_id, "modules": [str(m) for m in sm.modules]}
    doc = {"format": FORMAT, "version": metadata.version, "state_dict_metadata": state, "planner_data": planner,
           "items": items, "storage_meta": storage_meta}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode(), pickled


# -- decoding (untrusted input) --------------------------------------------------


def _ints(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise DCPMetadataError(f"{what} must be a list of at most {MAX_DIMS} integers")
    if not all(type(v) is int and 0 <= v < (1 << 62) for v in value):
        raise DCPMetadataError(f"{what} must hold non-negative integers, got {value!r}")
    return value


def _obj(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DCPMetadataError(f"{what} must be a JSON object")
    return value


def _tensor_entry(fqn: str, doc: dict[str, Any]) -> TensorStorageMetadata:
    size = _ints(doc.get("size"), f"{fqn!r} size")
    chunks = doc.get("chunks")
    if not isinstance(chunks, list):
        raise DCPMetadataError(f"{fqn!r}: chunks must be a list")
    out = []
    for chunk in chunks:
        if not isinstance(chunk, list) or len(chunk) != 2:
            raise DCPMetadataError(f"{fqn!r}: a chunk must be [offsets, sizes]")
        offsets, sizes = _ints(chunk[0], f"{fqn!r} chunk offsets"), _ints(chunk[1], f"{fqn!r} chunk sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise DCPMetadataError(f"{fqn!r}: a chunk has {len(offsets)}/{len(sizes)} dims, the tensor {len(size)}")
        if any(o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
            raise DCPMetadataError(f"{fqn!r}: chunk at {offsets} of {sizes} exceeds the tensor's size {size}")
        out.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    if not isinstance(doc.get("requires_grad"), bool):
        raise DCPMetadataError(f"{fqn!r}: requires_grad must be a boolean")
    props = TensorProperties(dtype=dtype_from_json(doc.get("dtype")), requires_grad=doc["requires_grad"])
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=out)


def _planner_data(doc: object, pickled: bytes | None) -> Any:
    planner = _obj(doc, "planner_data")
    kind = planner.get("kind")
    if kind == "pickle":
        if pickled is None:
            raise DCPMetadataError("the planner data is pickled but was not read")
        import pickle

        return pickle.loads(pickled)  # opted in with allow_pickle; its checksum verified before
    if kind != "flatten":
        raise DCPMetadataError(f"unknown planner data kind {kind!r}")
    mappings = planner.get("mappings")
    if mappings is None:
        return None
    out = {}
    for key, path in _obj(mappings, "planner_data mappings").items():
        if not isinstance(path, list) or len(path) > 4096 or not all(
                isinstance(p, str) or (type(p) is int and p >= 0) for p in path):
            raise DCPMetadataError(f"planner data of {key!r} must be a list of keys and indices")
        out[key] = tuple(path)
    return out


def planner_is_pickled(data: bytes) -> bool:
    """Whether a (verified) JSON document says its planner data is the pickled tensor :data:`PLANNER_NAME`."""
    doc = _load(data)
    planner = doc.get("planner_data")
    return isinstance(planner, dict) and planner.get("kind") == "pickle"


def _load(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_METADATA_BYTES:
        raise DCPMetadataError(f"DCP metadata of {len(data)} bytes exceeds the {MAX_METADATA_BYTES}-byte limit")
    try:
        doc = json.loads(bytes(data), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise DCPMetadataError(f"DCP metadata is not JSON: {exc}") from exc
    doc = _obj(doc, "DCP metadata")
    if doc.get("format") != FORMAT:
        raise DCPMetadataError(f"DCP metadata format {doc.get('format')!r} is not {FORMAT}")
    return doc


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not strict JSON")


def decode(data: bytes, *, world_size: int, pickled_planner_data: bytes | None = None) -> Metadata:
    """Parse a verified JSON document back into DCP's ``Metadata`` (``storage_data`` of :class:`ItemLocation`).

    Args:
        data: the JSON document.
        world_size: the number of ranks whose shards the version has (item ranks are checked against it).
        pickled_planner_data: the verified bytes of :data:`PLANNER_NAME` when the document says it is pickled.

    Raises:
        DCPMetadataError: anything malformed, out of bounds, or contradictory.
    """
    doc = _load(data)
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, entry in _obj(doc.get("state_dict_metadata"), "state_dict_metadata").items():
        entry = _obj(entry, f"{fqn!r}")
        if entry.get("type") == "bytes":
            state[fqn] = BytesStorageMetadata()
        elif entry.get("type") == "tensor":
            state[fqn] = _tensor_entry(fqn, entry)
        else:
            raise DCPMetadataError(f"{fqn!r}: unknown entry type {entry.get('type')!r}")
    items = doc.get("items")
    if not isinstance(items, list):
        raise DCPMetadataError("items must be a list")
    storage: dict[MetadataIndex, ItemLocation] = {}
    for item in items:
        if not isinstance(item, list) or len(item) != 4:
            raise DCPMetadataError("an item must be [fqn, offsets, rank, name]")
        fqn, offsets, rank, name = item
        if not isinstance(fqn, str) or fqn not in state:
            raise DCPMetadataError(f"item {fqn!r} is not in state_dict_metadata")
        if type(rank) is not int or not 0 <= rank < world_size:
            raise DCPMetadataError(f"item {fqn!r}: rank {rank!r} is not one of the version's {world_size} ranks")
        if not isinstance(name, str) or not name:
            raise DCPMetadataError(f"item {fqn!r}: the stored name must be a non-empty string")
        index = MetadataIndex(fqn, None if offsets is None else _ints(offsets, f"item {fqn!r} offsets"))
        if index in storage:
            raise DCPMetadataError(f"item {fqn!r} at {offsets} is listed twice")
        storage[index] = ItemLocation(rank, name)
    sm = doc.get("storage_meta")
    storage_meta = StorageMeta()
    if sm is not None:
        sm = _obj(sm, "storage_meta")
        checkpoint_id, save_id, modules = sm.get("checkpoint_id"), sm.get("save_id"), sm.get("modules", [])
        if not (checkpoint_id is None or isinstance(checkpoint_id, str)) or not (
                save_id is None or isinstance(save_id, str)) or not (
                isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
            raise DCPMetadataError("storage_meta is malformed")
        storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id, modules=modules)
    version = doc.get("version")
    if not (version is None or isinstance(version, str)):
        raise DCPMetadataError("version must be a string")
    planner_data = _planner_data(doc.get("planner_data"), pickled_planner_data)
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=storage,
                    storage_meta=storage_meta, version=version)

