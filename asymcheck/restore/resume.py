"""Resuming: the newest version that fits is read straight into the live model's tensors.

``resume()`` hands the store a function of each candidate version's manifest
(:meth:`asymstore.AsymStore.restore` with a callable ``into``). It first
checks that the version fits the live model, optimizer and stateful objects
using the manifest alone (names, dtypes, shapes and the JSON part, with
tensors on the ``meta`` device): a version that does not fit is refused
before a byte is written. It then names the live model tensors as
destinations, so each of their chunks is read from the tier into the
parameter itself (one copy; ``model.load_state_dict`` then copies nothing);
the optimizer's state tensors are read into the live ones where they exist
already (a job that stepped before resuming), and otherwise (before the
first step AdamW has none) into fresh tensors; ``optimizer.load_state_dict``
takes either as they are on CPU (and copies once to the device on CUDA).

A version that fails verification part way has written some parameters;
the store then reads an older version into the same tensors. If none
verifies, the live parameters hold no version at all: the Checkpointer
refuses to train on (:class:`~asymcheck.errors.CheckpointerStateError` at the
next optimizer step) rather than let training continue from a mixture.

A :class:`~asymstore.multirank.RankStore` (DDP, FSDP2) is read in place the
same way: each rank's chunks land in its live tensors (an FSDP2 rank's are
the local shards of its DTensor parameters and AdamW moments), so a resume
on the same number of ranks makes no fresh copy of the state and no second
pass over it. Its restore agrees on a version across ranks; a version refused
by the fit check on any rank is refused on every rank (the same
:class:`~asymcheck.errors.StateMismatchError`), never taken for a damaged
one (see :mod:`asymstore.multirank.restore`). A version of another world size
is resharded into fresh tensors (:mod:`asymstore.multirank.reshard`) and
copied in by ``load``. A state of its own kind (DeepSpeed's engine files)
resumes into fresh tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from asymcheck.errors import StateMismatchError
from asymcheck.state import dtensors
from asymcheck.state.encode import encode
from asymcheck.state.trainstate import TrainingState
from asymstore.api import Checkpoint, CheckpointStore, CollectiveStore
from asymstore.errors import DestinationMismatchError
from asymstore.format.manifest import Manifest
from asymstore.format.tensors import dtype_from_name

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
