"""One version's captured state: the flat tensors read lazily, the eager copies, and the moment of the step.

:class:`Capture` is what :class:`asymcheck.state.trainstate.TrainingState` fills when a
step returns (and again at the first training activity of the next
iteration); :class:`Moment` is the part that must be taken right when the
step returns (RNG states and ``data`` objects).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from asymstore.format.pieces import TensorLayout
from asymstore.format.tensors import host_copy

logger = logging.getLogger(__name__)


@dataclass
class Capture:
    """One version's state as captured so far.

    Attributes:
        names: the flat state's tensor names, in order.
        sources: the live tensors behind ``names`` (read later, in partitions).
        eager: private copies of small tensors, taken already.
        meta: the JSON part.
        owners: per source, the parameter it was detached from (checked for
            a replaced ``.data`` before the version is committed), or None.
        counters: per source, the tensor whose version counter in-place
            edits move (a DTensor for its local tensor; empty: the sources).
        layouts: where the sharded sources sit in their global tensors (DTensors).
        known: names taken out of the sources because their bytes are known unchanged since an
            earlier version (:mod:`asymcheck.snapshot.frozen`): the version takes a host copy.
    """

    names: list[str] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    eager: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    signature: tuple[int, ...] = ()
    owners: list[torch.Tensor | None] = field(default_factory=list)
    counters: list[torch.Tensor] = field(default_factory=list)
    layouts: dict[str, TensorLayout] = field(default_factory=dict)
    known: list[str] = field(default_factory=list)

    @property
    def versioned(self) -> list[torch.Tensor]:
        """The tensors whose ``_version`` tells whether a source was edited in place."""
        return self.counters or self.sources

    def make_eager(self, names: set[str]) -> int:
        """Copy the sources named in ``names`` now instead of lazily; return how many moved."""
        keep: list[tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        moved = 0
        for name, src, owner, counter in zip(self.names, self.sources, self.owners, self.versioned, strict=True):
            if name in names:
                self.eager[name] = host_copy(src)
                moved += 1
            else:
                keep.append((name, src, owner, counter))
        if moved:
            self.names = [k[0] for k in keep]
            self.sources = [k[1] for k in keep]
            self.owners = [k[2] for k in keep]
            self.counters = [k[3] for k in keep]
        return moved


@dataclass(frozen=True)
class Moment:
    """What must be taken right when a step returns: RNG states and the ``data`` objects.

    Attributes:
        meta: ``{"rng": ..., "data": {name: tree}}`` (JSON).
        tensors: the tensor parts (torch RNG states, tensors of data states), private copies.
    """

    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @classmethod
    def of(cls, cap: Capture) -> Moment:
        """The moment already in ``cap``."""
        return cls({"rng": cap.meta["rng"], "data": cap.meta.get("data", {})},
                   {k: v for k, v in cap.eager.items() if k.startswith(("rng/", "data/"))})

    def apply(self, cap: Capture) -> None:
        """Put this moment into ``cap`` (replacing an earlier one)."""
        for name in [n for n in cap.eager if n.startswith(("rng/", "data/"))]:
            del cap.eager[name]
        cap.eager.update(self.tensors)
        cap.meta.update(self.meta)
