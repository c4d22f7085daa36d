"""Tensors lent to DCP's saves: memory its owner does not write while the tensor object lives.

A stager (``asymcheck.dcp.Stager``) hands DCP views of its host slots and takes a slot back only
once every view of it is gone; it marks each view with :func:`lend`. :class:`~asymstore.dcp.StorageWriter`
then adopts a lent tensor (``adopt_many``: the store reads the slot itself, no private copy) instead of
copying it (``put_many``); the store holds the view until its commit is done with it, so the slot cannot
be reused before. Anything not lent is copied, as before.
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["is_lent", "lend"]

_LENT: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> the tensor (never a WeakSet: tensors compare elementwise)
_LOCK = threading.Lock()


def lend(tensor: torch.Tensor) -> None:
    """Mark ``tensor`` as memory nobody writes while the object lives (a contiguous CPU tensor; else ignored)."""
    if type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return
    key = id(tensor)

    def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
        with _LOCK:
            if _LENT.get(key) is ref:
                del _LENT[key]

    with _LOCK:
        _LENT[key] = weakref.ref(tensor, forget)


def is_lent(tensor: object) -> bool:
    """Whether ``tensor`` itself (this object) was marked by :func:`lend` and is alive."""
    ref = _LENT.get(id(tensor))
    return ref is not None and ref() is tensor
