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

A :class:`~asymstore.multirank.RankStore` (DDP) resumes into fresh tensors
and copies them in, as before: its restore agrees on a version across ranks,
and a refused version must not look like a damaged one there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from asymcheck.errors import StateMismatchError
from asymcheck.state.trainstate import TrainingState
from asymstore.api import Checkpoint, CheckpointStore, CollectiveStore
from asymstore.errors import DestinationMismatchError
from asymstore.format.manifest import Manifest
from asymstore.format.tensors import dtype_from_name

logger = logging.getLogger(__name__)


def live_destinations(state: TrainingState) -> Callable[[Manifest], Mapping[str, torch.Tensor]]:
    """The ``into`` function for ``state``: check the fit on the manifest, then name the live model tensors."""

    def into(manifest: Manifest) -> Mapping[str, torch.Tensor]:
        shadows = {name: torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
                   for name, entry in manifest.tensors.items()}
        state.check_fit(shadows, manifest.meta)  # StateMismatchError: refused before anything is read
        out = {}
        for name, tensor in {**state.model_tensors(), **state.optimizer_tensors()}.items():
            entry = manifest.tensors.get(name)
            if entry is not None and entry.shape == tuple(tensor.shape) and entry.dtype == _dtype(tensor):
                out[name] = tensor
        return out

    return into


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


async def restore_live(store: CheckpointStore, state: TrainingState) -> tuple[Checkpoint, bool]:
    """Restore the newest version that verifies; return it and whether it was read into the live tensors.

    Raises:
        StateMismatchError: the newest version does not fit (nothing was written).
        Everything :meth:`asymstore.AsymStore.restore` raises.
    """
    if isinstance(store, CollectiveStore):  # collective: every rank loads the same global version, fresh tensors
        return await store.restore(), False
    try:
        return await store.restore(into=live_destinations(state)), True
    except DestinationMismatchError as exc:
        if isinstance(exc.__cause__, StateMismatchError):
            raise exc.__cause__ from None
        raise
