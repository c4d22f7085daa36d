"""The RNG states an integration captures: a pass's starting states, and a version's states held to put back.

- :func:`pass_states` / :func:`set_pass_states`: the generators that decide a pass's order over a
  loader (the global torch CPU generator, under ``"torch"``, and the loader's own generators by
  role), recorded when a pass begins so a resume can draw the interrupted pass's order again.
- :class:`HeldRng`: every RNG state of the process (:mod:`asymcheck.state.rng`), held after a resume
  and put back at the framework's point (the framework's own loader iterator draws from them first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asymcheck.state import rng

__all__ = ["HeldRng", "pass_states", "set_pass_states"]

TORCH = "torch"
"""The role of the global torch CPU generator in a pass's states."""


def pass_states(generators: Mapping[str, torch.Generator]) -> dict[str, torch.Tensor]:
    """The states a pass draws its order from: the global torch generator's (``"torch"``) and ``generators``'."""
    states = {TORCH: torch.get_rng_state()}
    for role, g in generators.items():
        states[role] = g.get_state()
    return states


def set_pass_states(states: Mapping[str, torch.Tensor], generators: Mapping[str, torch.Generator]) -> None:
    """Set the global torch generator and each of ``generators`` to ``states`` (roles absent there are left alone)."""
    if TORCH in states:
        torch.set_rng_state(states[TORCH].clone())
    for role, g in generators.items():
        if role in states:
            g.set_state(states[role].clone())


class HeldRng:
    """A version's RNG states held until the framework has drawn what it draws on its own, then put back."""

    def __init__(self) -> None:
        """Hold nothing."""
        self._held: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None

    @property
    def held(self) -> bool:
        """States are held, not yet put back."""
        return self._held is not None

    def hold(self) -> None:
        """Capture every RNG state now (right after the version was loaded)."""
        tensors: dict[str, torch.Tensor] = {}
        self._held = (rng.capture(tensors), tensors)

    def put_back(self) -> bool:
        """Set the held states again, once; whether there were any."""
        held, self._held = self._held, None
        if held is None:
            return False
        rng.restore(*held)
        return True

    def drop(self) -> None:
        """Forget the held states."""
        self._held = None
