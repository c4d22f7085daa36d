"""Where each stored tensor sits in its global tensor: strict JSON in a version's meta (pure data, no torch).

``meta["layout"]`` gives, per stored tensor, its global shape and dtype, the offsets of the local
piece, the device mesh (listed once in ``meshes``, named by index) and one placement per mesh
dimension: ``"S(d)"`` (``torch.chunk`` pieces along dimension ``d``, uneven and empty pieces
included, never padding) or ``"R"`` (replicated). A tensor the layout does not list is held whole
(``"default": "whole"``). A version without ``"layout"`` says nothing about its tensors.
:func:`read_layouts` parses it as untrusted input: every number is checked, the piece must be
exactly the one the placements give this coordinate, and shape and dtype must match the manifest.

The layout, with an example: docs/guides/fsdp2.md.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asymstore.errors import LayoutError
from asymstore.format.manifest import DTYPE_SIZES, MAX_DIMS, Manifest

logger = logging.getLogger(__name__)

LAYOUT_KEY = "layout"
FORMAT = 1
DEFAULT = "whole"  # what a tensor the layout does not list is
MAX_MESH_RANKS = 1 << 22
MAX_MESHES = 1024
_SHARD = re.compile(r"^S\((\d{1,2})\)$")


def _ints(value: object, what: str, *, limit: int = MAX_DIMS) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > limit:
        raise LayoutError(f"{what} must be a list of at most {limit} integers")
    if not all(type(v) is int and v >= 0 for v in value):
        raise LayoutError(f"{what} must hold non-negative integers, got {value!r}")
    return tuple(value)


def chunk_piece(size: int, pieces: int, index: int) -> tuple[int, int]:
    """The ``(offset, length)`` of piece ``index`` when ``size`` elements are cut like ``torch.chunk``.

    Every piece but the last ones is ``ceil(size / pieces)`` long; pieces past
    the end are empty and start at ``size`` (as DTensor's ``Shard`` places them).
    """
    full = -(-size // pieces) if pieces else 0
    start = full * index
    return min(size, start), max(0, min(size, start + full) - start)


@dataclass(frozen=True)
class MeshInfo:
    """The device mesh a tensor is laid out on.

    Attributes:
        shape: the mesh's shape.
        ranks: the global ranks on the mesh, row-major.
        coordinate: this rank's coordinate on it.
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    coordinate: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object."""
        return {"shape": list(self.shape), "ranks": list(self.ranks), "coordinate": list(self.coordinate)}

    @classmethod
    def from_json(cls, doc: object) -> MeshInfo:
        """Parse and check a mesh object.

        Raises:
            LayoutError: it is malformed.
        """
        if not isinstance(doc, dict):
            raise LayoutError(f"mesh must be an object, got {type(doc).__name__}")
        shape = _ints(doc.get("shape"), "mesh shape")
        ranks = _ints(doc.get("ranks"), "mesh ranks", limit=MAX_MESH_RANKS)
        coordinate = _ints(doc.get("coordinate"), "mesh coordinate")
        if not shape or len(coordinate) != len(shape) or any(c >= n for c, n in zip(coordinate, shape, strict=True)):
            raise LayoutError(f"mesh coordinate {list(coordinate)} is not on a mesh of shape {list(shape)}")
        if len(ranks) != math.prod(shape) or len(set(ranks)) != len(ranks):
            raise LayoutError(f"a mesh of shape {list(shape)} needs {math.prod(shape)} distinct ranks")
        return cls(shape, ranks, coordinate)


@dataclass(frozen=True)
class TensorLayout:
    """Which piece of which global tensor one stored tensor is.

    Attributes:
        global_shape: the global tensor's shape.
        dtype: its dtype name (as in the manifest).
        offsets: where the local piece starts, per dimension.
        shape: the local piece's shape (unpadded).
        mesh: the device mesh, or None for a tensor held whole.
        placements: per mesh dimension, ``"S(d)"`` or ``"R"``.
    """

    global_shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    mesh: MeshInfo | None = None
    placements: tuple[str, ...] = ()

    @classmethod
    def whole(cls, shape: Sequence[int], dtype: str) -> TensorLayout:
        """A tensor this rank holds whole (global shape = its shape, offsets 0)."""
        shape = tuple(int(d) for d in shape)
        return cls(shape, dtype, (0,) * len(shape), shape)

    @classmethod
    def sharded(cls, global_shape: Sequence[int], dtype: str, mesh: MeshInfo,
                placements: Sequence[str]) -> TensorLayout:
        """The piece ``mesh.coordinate`` holds of a global tensor cut by ``placements``.

        Raises:
            LayoutError: a placement is not ``"S(d)"`` with ``d`` a dimension, nor ``"R"``.
        """
        global_shape = tuple(int(d) for d in global_shape)
        placements = tuple(placements)
        if len(placements) != len(mesh.shape):
            raise LayoutError(f"{len(placements)} placement(s) for a {len(mesh.shape)}-D mesh")
        offsets = [0] * len(global_shape)
        shape = list(global_shape)
        for n, coord, placement in zip(mesh.shape, mesh.coordinate, placements, strict=True):
            dim = shard_dim(placement, len(global_shape))
            if dim is None:
                continue
            start, length = chunk_piece(shape[dim], n, coord)
            offsets[dim] += start
            shape[dim] = length
        return cls(global_shape, dtype, tuple(offsets), tuple(shape), mesh, placements)

    @property
    def is_whole(self) -> bool:
        """Whether this rank holds the whole global tensor."""
        return self.shape == self.global_shape

    def to_json(self, mesh_index: int | None = None) -> dict[str, Any]:
        """Return the JSON object; its mesh inline, or as ``mesh_index`` into a version's ``meshes``."""
        mesh: Any = None if self.mesh is None else self.mesh.to_json() if mesh_index is None else mesh_index
        return {"global_shape": list(self.global_shape), "dtype": self.dtype, "offsets": list(self.offsets),
                "shape": list(self.shape), "mesh": mesh, "placements": list(self.placements)}

    @classmethod
    def from_json(cls, doc: object, meshes: Sequence[MeshInfo] = ()) -> TensorLayout:
        """Parse and check one tensor's layout (its mesh inline, or an index into ``meshes``).

        Raises:
            LayoutError: it is malformed, or its piece is not the one its placements give.
        """
        if not isinstance(doc, dict):
            raise LayoutError(f"a tensor layout must be an object, got {type(doc).__name__}")
        global_shape = _ints(doc.get("global_shape"), "global_shape")
        offsets = _ints(doc.get("offsets"), "offsets")
        shape = _ints(doc.get("shape"), "shape")
        dtype = doc.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise LayoutError(f"unknown dtype {dtype!r}")
        if not len(global_shape) == len(offsets) == len(shape):
            raise LayoutError("global_shape, offsets and shape must have as many dimensions")
        placements = doc.get("placements")
        if not isinstance(placements, list) or not all(isinstance(p, str) for p in placements):
            raise LayoutError("placements must be a list of strings")
        if doc.get("mesh") is None:
            if placements:
                raise LayoutError("placements without a mesh")
            layout = cls(global_shape, dtype, offsets, shape)
            if not layout.is_whole or any(offsets):
                raise LayoutError("a tensor without a mesh must be held whole (offsets 0, shape = global_shape)")
            return layout
        ref = doc["mesh"]
        if type(ref) is int:
            if not 0 <= ref < len(meshes):
                raise LayoutError(f"mesh index {ref} is not one of the {len(meshes)} mesh(es) listed")
            mesh = meshes[ref]
        else:
            mesh = MeshInfo.from_json(ref)
        expected = cls.sharded(global_shape, dtype, mesh, placements)
        if expected.offsets != offsets or expected.shape != shape:
            raise LayoutError(f"piece at {list(offsets)} of shape {list(shape)} is not the one its placements give "
                              f"(at {list(expected.offsets)}, shape {list(expected.shape)})")
        return expected


def shard_dim(placement: str, ndim: int) -> int | None:
    """The tensor dimension ``placement`` shards (``"S(d)"``), or None for ``"R"``.

    Raises:
        LayoutError: any other placement, or ``d`` out of range.
    """
    if placement == "R":
        return None
    match = _SHARD.match(placement)
    if match is None or int(match.group(1)) >= ndim:
        raise LayoutError(f"unsupported placement {placement!r} for a {ndim}-D tensor (only 'S(d)' and 'R')")
    return int(match.group(1))


def layout_meta(layouts: Mapping[str, TensorLayout]) -> dict[str, Any]:
    """The ``meta["layout"]`` value for ``layouts``: each distinct mesh listed once, tensors held whole left out."""
    index: dict[MeshInfo, int] = {}
    tensors = {}
    for name, layout in layouts.items():
        if layout.mesh is None:
            continue  # held whole: the default
        tensors[name] = layout.to_json(index.setdefault(layout.mesh, len(index)))
    return {"format": FORMAT, "default": DEFAULT, "meshes": [m.to_json() for m in index], "tensors": tensors}


def parse_layout_meta(doc: object) -> dict[str, TensorLayout]:
    """Parse a ``meta["layout"]`` value (untrusted); the tensors it lists, by name.

    Raises:
        LayoutError: it is malformed.
    """
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tensors"), dict) \
            or doc.get("default") != DEFAULT:
        raise LayoutError(f"meta[{LAYOUT_KEY!r}] is not a layout of format {FORMAT} (default {DEFAULT!r})")
    listed = doc.get("meshes", [])
    if not isinstance(listed, list) or len(listed) > MAX_MESHES:
        raise LayoutError(f"meshes must be a list of at most {MAX_MESHES}")
    meshes = [MeshInfo.from_json(m) for m in listed]
    out: dict[str, TensorLayout] = {}
    for name, entry in doc["tensors"].items():
        try:
            out[name] = TensorLayout.from_json(entry, meshes)
        except LayoutError as exc:
            raise LayoutError(f"{name!r}: {exc}") from None
    return out


def read_layouts(manifest: Manifest) -> dict[str, TensorLayout]:
    """Every stored tensor's layout, checked against the manifest's tensor entries.

    A tensor ``meta["layout"]`` does not list is held whole (so is every
    tensor of a version written before layouts were recorded).

    Raises:
        LayoutError: the layout part is malformed, names a tensor the version
            lacks, or disagrees with a tensor's dtype or shape.
    """
    doc = manifest.meta.get(LAYOUT_KEY)
    given = {} if doc is None else parse_layout_meta(doc)
    out: dict[str, TensorLayout] = {}
    for name, tensor in manifest.tensors.items():
        layout = given.pop(name, None) or TensorLayout.whole(tensor.shape, tensor.dtype)
        if layout.shape != tuple(tensor.shape) or layout.dtype != tensor.dtype:
            raise LayoutError(f"{name!r}: layout says {list(layout.shape)} {layout.dtype}, "
                              f"the version holds {list(tensor.shape)} {tensor.dtype}")
        out[name] = layout
    if given:
        raise LayoutError(f"layout names tensors the version does not hold: {sorted(given)[:5]}")
    return out
