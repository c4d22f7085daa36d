"""Where a pass over a data loader is, and a loader that carries it into every version.

:class:`LoaderPosition` is the position every integration keeps of a pass: the batches of the pass
trained, the RNG states it began with, and a pass to continue after a resume (drawn from the
interrupted pass's starting states, its trained batches skipped). :class:`ResumableLoader` is the
base of the framework loaders (``asymcheck.accelerate.ResumableLoader``,
``asymcheck.lightning.ResumableLoader``): one set of attributes, the framework's own parts (which
generators decide a pass's order, how batches are skipped without reading them, the state format
its versions hold) in the subclass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from asymcheck.integrations.rng import TORCH, pass_states, set_pass_states

__all__ = ["LoaderPosition", "ResumableLoader"]

T = TypeVar("T")
_END = object()


class LoaderPosition:
    """The position of a pass over a loader: batches trained, the RNG states it began with, a pass to continue.

    Attributes:
        batches: batches of the current (or last) pass trained.
        start: the RNG states the current pass began with (see :func:`asymcheck.integrations.rng.pass_states`).
    """

    def __init__(self) -> None:
        """No pass yet."""
        self.batches = 0
        self.start: dict[str, torch.Tensor] = {}
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def continuing(self) -> bool:
        """The next pass continues an interrupted one (until :meth:`resumed`)."""
        return self._pending is not None

    @property
    def pending(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The pass to continue: batches it had trained and the RNG states it began with (None: none)."""
        return self._pending

    def begin(self, generators: Mapping[str, torch.Generator]) -> None:
        """A new pass begins: record the states it draws its order from; no batch trained yet."""
        self.start = pass_states(generators)
        self.batches = 0

    def continue_at(self, batches: int, start: Mapping[str, torch.Tensor]) -> None:
        """Make the next pass continue the one that began with ``start`` after ``batches`` trained batches."""
        self._pending = (batches, {str(k): v for k, v in start.items() if isinstance(v, torch.Tensor)})

    def resumed(self) -> None:
        """The continued pass trains: passes after it are the loader's own."""
        self._pending = None

    def continued(self, generators: Mapping[str, torch.Generator], items: Callable[[], Iterator[T]],
                  pending: tuple[int, Mapping[str, torch.Tensor]] | None = None) -> Iterator[T]:
        """The interrupted pass, continued: ``items()`` (what is left of it) drawn from the pass's starting states.

        The starting states are set (and recorded as this pass's) while ``items()`` and its first item
        draw, then the global torch RNG is put back as it was, so the version's states go on.
        ``batches`` starts at the batches already trained.

        Args:
            generators: the loader's generators that decide the pass's order, by role.
            items: what is left of the pass (its trained batches skipped), made under the starting states.
            pending: the pass to continue (default: :attr:`pending`, read when the first item is asked for).
        """
        skip, start = pending if pending is not None else (self._pending or (0, {}))
        self.batches = skip
        outer = torch.get_rng_state()
        set_pass_states(start, generators)
        self.start = pass_states(generators) if TORCH in start else dict(start)
        try:
            it = items()
            first = next(it, _END)
        finally:
            torch.set_rng_state(outer)
        if first is _END:
            return
        yield first  # type: ignore[misc]
        yield from it


class ResumableLoader:
    """A data loader whose pass position goes into every version and comes back without re-reading.

    The base of each framework's loader (``asymcheck.accelerate.ResumableLoader``,
    ``asymcheck.lightning.ResumableLoader``). Each pass records the RNG states it began with (the
    global torch CPU generator and the loader's generators: they decide a shuffled pass's order);
    after a resume the first pass draws from the interrupted pass's states and goes on after the
    batches already trained, whose samples are not read where the loader allows it.

    Attributes:
        loader: the wrapped loader.
        name: its name in a version.
        position: the pass position (:class:`LoaderPosition`).
    """

    def __init__(self, loader: Any, name: str = "loader") -> None:
        """Wrap ``loader``."""
        self.loader = loader
        self.name = name
        self.position = LoaderPosition()

    @property
    def batches(self) -> int:
        """Batches of the current (or last) pass trained."""
        return self.position.batches

    @batches.setter
    def batches(self, value: int) -> None:
        self.position.batches = value

    def __len__(self) -> int:
        """The loader's batches per pass."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        """One pass (the framework's loader says how)."""
        raise NotImplementedError

    def generators(self) -> dict[str, torch.Generator]:
        """The loader's generators that decide a pass's order, by role: here the loader's ``generator``."""
        g = getattr(self.loader, "generator", None)
        return {"generator": g} if isinstance(g, torch.Generator) else {}

    def state_dict(self) -> dict[str, Any]:
        """The position, as the framework's versions hold it."""
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass continue the one ``state`` describes."""
        raise NotImplementedError
