"""The reserved names of the integrations' own state in a version: ``<framework>.<what>[.<i>]``.

Every object an integration puts into a version under its own name (beside the user's
``stateful=`` / ``data=`` objects) is named ``<framework>.<what>``, with ``.<i>`` when there are
several of a kind. Earlier releases named the Trainer's two ``trainer_state`` and
``lr_scheduler``; versions with those names still restore (see
:data:`asymcheck.state.trainstate.RENAMED`).
"""

from __future__ import annotations

__all__ = ["ACCELERATE_SCALER", "ACCELERATE_SCHEDULER", "ACCELERATE_STEP", "HF_SCHEDULER", "HF_TRAINER_STATE",
           "LIGHTNING_FIT_LOOP", "LIGHTNING_SCHEDULER", "reserved"]

ACCELERATE_STEP = "accelerate.step"
"""``accelerator.step`` (a ``data`` object: it advances when a batch is drawn)."""
ACCELERATE_SCHEDULER = "accelerate.scheduler"
ACCELERATE_SCALER = "accelerate.scaler"
HF_TRAINER_STATE = "hf.trainer_state"
"""The Trainer's ``TrainerState`` (earlier releases: ``trainer_state``)."""
HF_SCHEDULER = "hf.scheduler"
"""The Trainer's LR scheduler (earlier releases: ``lr_scheduler``)."""
LIGHTNING_FIT_LOOP = "lightning.fit_loop"
LIGHTNING_SCHEDULER = "lightning.scheduler"
"""With ``.<i>``: the ``i``-th LR scheduler of ``configure_optimizers``."""


def reserved(framework: str, what: str, index: int | None = None) -> str:
    """The reserved name ``<framework>.<what>[.<index>]``."""
    return f"{framework}.{what}" if index is None else f"{framework}.{what}.{index}"
