"""Where the training loop is, as the Checkpointer's parts see it: one small record they share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    """The training loop's position and the Checkpointer's life, shared by the Checkpointer and its parts.

    The :class:`asymcheck.Checkpointer` owns it and advances it from its
    hooks; its version cycle (:class:`~asymcheck.versions.cycle.VersionCycle`)
    and its preemption (:class:`~asymcheck.policy.preempt.Preemption`) read it,
    and record the steps they save and the moment the Checkpointer closes.

    Attributes:
        step: optimizer steps completed (including those before a resume).
        saved_step: the newest step restored or handed to a commit, if any.
        in_step: inside ``optimizer.step()`` (between its pre- and post-hook).
        started: an optimizer step ran under this Checkpointer.
        closed: closed (or preempted): every hook is a no-op from now on.
    """

    step: int = 0
    saved_step: int | None = None
    in_step: bool = False
    started: bool = False
    closed: bool = False
