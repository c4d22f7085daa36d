"""Resuming: the newest version that fits is read straight into the live model's tensors.

``resume()`` passes :meth:`asymstore.AsymStore.restore` a function of each candidate manifest: it
first checks, from the manifest alone, that the version fits the live model, optimizer and
stateful objects (a misfit is refused before a byte is written), then names the live tensors as
destinations so each chunk lands in its parameter or optimizer state with one copy. If no
version verifies after some bytes landed, the Checkpointer refuses the next optimizer step
(:class:`~asymcheck.errors.CheckpointerStateError`) rather than train on a mixture. A
:class:`~asymstore.multirank.RankStore` is read in place the same way after the ranks agree on a
fitting version (:mod:`asymstore.multirank.restore`); another world size is resharded
(:mod:`asymstore.multirank.reshard`).

How the bytes travel: docs/concepts/data-path.md; FSDP2 and other world sizes: docs/guides/fsdp2.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from asymcheck.errors import StateMismatchError
from asymcheck.state import dtensors
from asymcheck.state.encode import encode
from asymcheck.state.trainstate import TrainingState
from asymstore.errors import DestinationMismatchError
from asymstore.format.manifest import Manifest
from asymstore.format.tensors import dtype_from_name
from asymstore.protocols import CheckpointStore, CollectiveStore
from asymstore.values import Checkpoint

logger = logging.getLogger(__name__)


def live_destinations(state: TrainingState,
                      used: list[Manifest] | None = None) -> Callable[[Manifest], Mapping[str, torch.Tensor]]:
    """The ``into`` function for ``state``: check the fit on the manifest, then name the live tensors.

    The live tensors are the model's (a DTensor's local shard) and the
    optimizer's existing state tensors (plain ones, and the local shards of
    DTensor ones), each only where the manifest stores the same dtype and
    shape. Each manifest the function named destinations for is appended to
    ``used`` (the live tensors may hold bytes of it from then on).
    """

    def into(manifest: Manifest) -> Mapping[str, torch.Tensor]:
        shadows = {name: torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
                   for name, entry in manifest.tensors.items()}
        state.check_fit(shadows, manifest.meta)  # StateMismatchError: refused before anything is read
        out = {}
        for name, tensor in {**state.model_tensors(), **_optimizer_tensors(state)}.items():
            entry = manifest.tensors.get(name)
            if entry is not None and entry.shape == tuple(tensor.shape) and entry.dtype == _dtype(tensor):
                out[name] = tensor
        if used is not None:
            used.append(manifest)
        return out

    return into


def _optimizer_tensors(state: TrainingState) -> dict[str, torch.Tensor]:
    """The optimizer's existing state tensors by checkpoint name: plain ones, and DTensors' local shards."""
    found: dict[str, torch.Tensor] = {}
    encode(state.optimizer.state_dict()["state"], "optim/state", found)
    return {name: dtensors.local_of(t) for name, t in found.items()
            if type(t) is torch.Tensor or dtensors.is_dtensor(t)}


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


async def restore_live(store: CheckpointStore, state: TrainingState) -> tuple[Checkpoint, bool]:
    """Restore the newest version that verifies; return it and whether the live tensors may hold bytes of one.

    Raises:
        StateMismatchError: the newest version does not fit (nothing was written; on a collective
            store, it did not fit on some rank).
        Everything :meth:`asymstore.AsymStore.restore` raises.
    """
    if isinstance(store, CollectiveStore) and type(state) is not TrainingState:  # DeepSpeed's files: fresh tensors
        return await store.restore(), False
    used: list[Manifest] = []
    try:
        ckpt = await store.restore(into=live_destinations(state, used))
    except DestinationMismatchError as exc:
        if isinstance(exc.__cause__, StateMismatchError):
            raise exc.__cause__ from None
        if isinstance(store, CollectiveStore):  # another rank's live objects refused it (its cause stays there)
            raise StateMismatchError(str(exc)) from exc
        raise
    return ckpt, bool(used)
