"""Resuming a multi-rank version on another number of ranks: which piece of each global tensor this rank holds now.

:func:`enable_resharding` gives a :class:`~asymstore.multirank.RankStore` the
function it asks, during a restore of a version written by another number of
ranks, for this rank's new piece of every sharded global tensor (see
:mod:`asymstore.multirank.reshard`, which reads only the overlapping
bytes). The piece is cut like the old one (the same placements, e.g. FSDP2's
``Shard(0)``) over the live model's device mesh; a model with no DTensor
takes every tensor whole (a single process resuming an FSDP2 run without
FSDP). The state held whole per rank (RNG states, data positions, the JSON
meta) comes from old rank ``rank % N``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from asymcheck.errors import StateMismatchError
from asymcheck.state import dtensors
from asymcheck.state.trainstate import TrainingState
from asymstore.format.pieces import MeshInfo, TensorLayout
from asymstore.protocols import CheckpointStore, ReshardingStore

logger = logging.getLogger(__name__)


def new_pieces(state: TrainingState, old: Mapping[str, TensorLayout]) -> dict[str, TensorLayout]:
    """This rank's piece, on the live mesh, of every global tensor ``old`` describes.

    Raises:
        StateMismatchError: the live model has DTensors but no single mesh of the old mesh's dimensions.
    """
    meshes = dtensors.live_meshes(state.live_tensors())
    out: dict[str, TensorLayout] = {}
    for name, lay in old.items():
        if not meshes or lay.mesh is None:
            out[name] = TensorLayout.whole(lay.global_shape, lay.dtype)
            continue
        fits: list[MeshInfo] = [m for m in meshes if len(m.shape) == len(lay.mesh.shape)]
        if len(fits) != 1:
            raise StateMismatchError(f"{name} was sharded on a {len(lay.mesh.shape)}-D mesh; the live model has "
                                     f"{len(fits)} such meshes: cannot tell which piece this rank holds now")
        out[name] = TensorLayout.sharded(lay.global_shape, lay.dtype, fits[0], lay.placements)
    return out


def enable_resharding(store: CheckpointStore, state: TrainingState) -> None:
    """Let a resharding store restore versions of another world size into ``state`` (no-op for other stores)."""
    if isinstance(store, ReshardingStore):
        store.reshard = lambda old: new_pieces(state, old)
