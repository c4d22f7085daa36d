"""Resharding plans: which bytes of which old rank's piece fill a new piece of a global tensor (pure, no I/O).

A version saved on N ranks holds, per rank, pieces of global tensors whose
places :mod:`asymstore.format.pieces` records. A rank of a job of M ranks
wants its own piece (a box of the global tensor); :func:`plan_piece` lists,
for every old piece it overlaps, the overlapping box and the smallest byte
range of the old piece that holds it (row-major: for FSDP2's ``Shard(0)`` the
overlap is exactly a run of whole rows, one contiguous range). Old pieces of
a replicated mesh dimension are taken from coordinate 0 of that dimension
only, so the pieces used never overlap; they must cover the new piece
exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from asymstore.errors import LayoutError
from asymstore.format.manifest import DTYPE_SIZES
from asymstore.format.pieces import TensorLayout, shard_dim

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PieceRead:
    """One overlap of an old piece with the wanted piece.

    Attributes:
        rank: the old rank holding the piece.
        lo: the overlap's first index per dimension, in global coordinates.
        hi: one past its last index per dimension.
        start: first byte of the old piece (its local tensor, row-major) to read.
        stop: one past the last byte to read.
    """

    rank: int
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The overlap's shape."""
        return tuple(h - lo for lo, h in zip(self.lo, self.hi, strict=True))


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides (in elements) of a contiguous tensor of ``shape``."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * max(1, shape[d + 1])
    return tuple(out)


def _primary(layout: TensorLayout) -> bool:
    """Whether this piece is the one copy used of its region (coordinate 0 along every replicated mesh dim)."""
    if layout.mesh is None:
        return True
    ndim = len(layout.global_shape)
    return all(c == 0 for c, p in zip(layout.mesh.coordinate, layout.placements, strict=True)
               if shard_dim(p, ndim) is None)


def plan_piece(want: TensorLayout, old: Mapping[int, TensorLayout]) -> list[PieceRead]:
    """The reads that fill ``want`` (a piece of a global tensor) from the old ranks' pieces ``old``.

    Raises:
        LayoutError: the old pieces are of another global tensor (shape or
            dtype), or do not cover ``want`` exactly once.
    """
    size = DTYPE_SIZES[want.dtype]
    reads: list[PieceRead] = []
    for rank, piece in sorted(old.items()):
        if piece.global_shape != want.global_shape or piece.dtype != want.dtype:
            raise LayoutError(f"rank {rank} holds a piece of a {list(piece.global_shape)} {piece.dtype} tensor, "
                              f"not of {list(want.global_shape)} {want.dtype}")
        if not _primary(piece):
            continue
        lo = tuple(max(a, b) for a, b in zip(want.offsets, piece.offsets, strict=True))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(want.offsets, want.shape, piece.offsets, piece.shape,
                                                             strict=True))
        if not math.prod(want.shape) or any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue  # nothing wanted, or no overlap
        st = strides(piece.shape)
        first = sum((low - o) * s for low, o, s in zip(lo, piece.offsets, st, strict=True))
        last = sum((h - 1 - o) * s for h, o, s in zip(hi, piece.offsets, st, strict=True))
        reads.append(PieceRead(rank, lo, hi, first * size, (last + 1) * size))
    covered = sum(math.prod(r.shape) for r in reads)
    if covered != math.prod(want.shape):
        raise LayoutError(f"the old pieces cover {covered} of the {math.prod(want.shape)} elements wanted "
                          f"at {list(want.offsets)} of a {list(want.global_shape)} tensor")
    return reads
