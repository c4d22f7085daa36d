"""Edits between steps: what the Checkpointer does when a captured tensor changes before its lazy copy.

A version holds each tensor's value when ``optimizer.step()`` returned. The
lazy copy reads parameters and optimizer tensors during the next iteration,
so an in-place edit before that read (an EMA swap, ``load_state_dict``,
``nn.Embedding(max_norm=...)`` renormalising its weight in the forward,
``p.data.mul_()``) would put other values, or a mix, into the version. Such a
change is detected (:mod:`asymcheck.snapshot.version`): the version is dropped, never
committed, counted in ``stats().versions_dropped``, and a warning says once
what to do. The tensors found changed are copied eagerly when each later
version opens (``stats().eager_tensors``), so edits that recur every
iteration cost stall time, not versions. Code that edits parameters on
purpose belongs in ``with ckpt.editing():``, which finishes the pending copy
first.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable

logger = logging.getLogger(__name__)

ADVICE = ("wrap code that edits parameters between steps (EMA evaluation, weight surgery, load_state_dict) in "
          "`with ckpt.editing():`, which finishes the pending copy first")


class DroppedVersionWarning(UserWarning):
    """A version was dropped because a captured tensor changed before it was copied."""


class EditTracker:
    """Counts dropped versions, learns which tensors get edited, warns once."""

    def __init__(self) -> None:
        """Nothing dropped yet."""
        self.dropped = 0
        self.eager: set[str] = set()
        self._warned = False

    def dropped_version(self, step: int, names: Iterable[str]) -> None:
        """Record that version ``step`` was dropped because ``names`` changed before their copy."""
        names = sorted(names)
        self.dropped += 1
        new = set(names) - self.eager
        self.eager |= set(names)
        shown = ", ".join(names[:4]) + ("..." if len(names) > 4 else "")
        logger.warning("version %d dropped: %d tensor(s) changed after the step, before they were copied (%s); "
                       "%d tensor(s) now copied eagerly", step, len(names), shown, len(new))
        if not self._warned:
            self._warned = True
            warnings.warn(f"asymcheck: version {step} dropped (not committed): {shown} changed in place between "
                          f"optimizer steps, before the lazy copy read it. Those tensors are copied eagerly from "
                          f"now on; to keep every version at no extra stall, {ADVICE}.",
                          DroppedVersionWarning, stacklevel=4)
