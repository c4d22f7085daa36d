"""torchdata's ``StatefulDataLoader`` in a version: its ``state_dict`` and the live state of its generators.

``StatefulDataLoader.load_state_dict`` puts the sampler's position back but not its generator where the
uninterrupted run has it: the sampler iterator snapshots the generator when it is made, before the
loader draws its base seed from the same generator, and a restored iterator sets that snapshot back and
draws the permutation again, one base-seed draw short. The epoch that was interrupted continues
right; every epoch after it would be shuffled differently from the uninterrupted run (tested in
tests/asymcheck/test_kill.py, case ``sloader``, which fails without this module).

So a version takes, beside the loader's ``state_dict``, the live state of the loader's generator and of
its sampler's (one or two ``torch.Generator``); a restore loads the loader's state, makes the restored
iterator at once (``state_dict()`` makes it, and the loader's next ``iter()`` returns that very
iterator), then sets the generators to their live states. The global RNG states are put back after
this (:meth:`asymcheck.state.trainstate.TrainingState.load`), so a draw the loader makes from them here
changes nothing. Any other object goes through its own ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from asymcheck.errors import StateMismatchError

__all__ = ["check", "is_stateful_loader", "load_state_dict", "state_dict"]

LOADER = "torchdata"
GENERATORS = "generators"


def is_stateful_loader(obj: object) -> bool:
    """Whether ``obj`` is a torchdata ``StatefulDataLoader`` (torchdata is not imported for it)."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    cls = getattr(module, "StatefulDataLoader", None) if module is not None else None
    return cls is not None and isinstance(obj, cls)


def _generators(loader: Any) -> list[torch.Generator]:
    """The loader's generator and its sampler's, each once, in that order."""
    found: list[torch.Generator] = []
    for owner in (loader, getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None),
                                                                     "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not seen for seen in found):
            found.append(g)
    return found


def _loader_class() -> Any:
    """The ``StatefulDataLoader`` class of torchdata (imported already: :func:`is_stateful_loader` said so)."""
    return sys.modules["torchdata.stateful_dataloader"].StatefulDataLoader


def state_dict(obj: Any, *, own: bool = True) -> Any:
    """What a version holds for ``obj``: a StatefulDataLoader's state and its generators', else ``obj.state_dict()``.

    Args:
        obj: the object.
        own: a StatefulDataLoader subclass's state as its own ``state_dict`` makes it (default), or, False,
            as torchdata's ``StatefulDataLoader.state_dict`` does, for a subclass whose override re-encodes it
            (TorchTitan's ``ParallelAwareDataloader`` pickles it).
    """
    if not is_stateful_loader(obj):
        return obj.state_dict()
    state = obj.state_dict() if own else _loader_class().state_dict(obj)
    return {LOADER: state, GENERATORS: [g.get_state() for g in _generators(obj)]}


def _wrapped(obj: Any, state: Any) -> bool:
    return is_stateful_loader(obj) and isinstance(state, Mapping) and set(state) == {LOADER, GENERATORS}


def check(name: str, obj: Any, state: Any) -> None:
    """Refuse ``state`` for ``obj`` before anything is loaded when its generators do not match the loader's.

    Raises:
        StateMismatchError: the version holds another number of generator states than the loader has.
    """
    if _wrapped(obj, state) and len(state[GENERATORS]) != len(_generators(obj)):
        raise StateMismatchError(f"{name}: the version holds {len(state[GENERATORS])} generator states for this "
                                 f"StatefulDataLoader, which has {len(_generators(obj))} (another sampler?)")


def load_state_dict(obj: Any, state: Any, *, own: bool = True) -> None:
    """Put ``state`` (from :func:`state_dict` with the same ``own``, checked by :func:`check`) back into ``obj``."""
    if not _wrapped(obj, state):
        obj.load_state_dict(state)
        return
    live = _generators(obj)
    saved = list(state[GENERATORS])
    methods = obj if own else _TorchdataMethods(obj)
    methods.load_state_dict(state[LOADER])
    methods.state_dict()  # makes the restored iterator now; the loader's next iter() returns it
    for g, s in zip(live, saved, strict=True):
        g.set_state(s)


class _TorchdataMethods:
    """torchdata's own ``state_dict`` / ``load_state_dict`` of a StatefulDataLoader subclass that overrides them."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def state_dict(self) -> Any:
        return _loader_class().state_dict(self._loader)

    def load_state_dict(self, state: Any) -> None:
        _loader_class().load_state_dict(self._loader, state)
