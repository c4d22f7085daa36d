"""Preemption: on SIGTERM, finish the version in flight on the durable tier, then let the process exit.

Schedulers (Slurm, Kubernetes, spot instances, torchrun) send SIGTERM and a
grace period before SIGKILL. The signal handler only records the notice: a
handler runs between any two bytecodes of the training thread, possibly in
the middle of ``optimizer.step()``, where no consistent state exists. The
Checkpointer acts at its next hook of the next iteration instead (a training
forward, a gradient, the next optimizer step) — never in the step's own
post-hook, before the loop ran its ``scheduler.step()`` — where the state
after the newest completed step is whole: it seals that version, copies what
is left, commits it durably, waits for every commit in flight, and then
hands the signal on to whatever the program had installed before — the
default action terminates the process with SIGTERM's usual status, a Python
handler is called, an ignored signal stays ignored. A process that reaches
no hook within the scheduler's grace period is killed as before, with the
durable tier holding the versions committed until then.

``Checkpointer.preempt()`` does the same on an explicit notice (a scheduler
that announces preemption another way), from the training thread, without
exiting.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

logger = logging.getLogger(__name__)

PreemptOn = Literal["sigterm", "none"]
PREEMPT_ON: tuple[PreemptOn, ...] = ("sigterm", "none")
Handler = Callable[[int, FrameType | None], Any] | int | None


@dataclass(frozen=True)
class PreemptionRecord:
    """What a preemption flush managed.

    Attributes:
        reason: ``"SIGTERM"`` or ``"explicit"``.
        step: the newest completed optimizer step at the flush.
        durable: whether every version up to ``step`` was committed durably in time.
        seconds: time the flush took.
        versions: the store's committed steps per tier afterwards.
    """

    reason: str
    step: int
    durable: bool
    seconds: float
    versions: dict[str, list[int]]


class SigtermNotice:
    """Records a SIGTERM for the Checkpointer's next hook, and hands the signal on afterwards."""

    def __init__(self, on: PreemptOn) -> None:
        """Install the handler (``on="sigterm"``, from the main thread only; elsewhere Python cannot)."""
        if on not in PREEMPT_ON:
            raise ValueError(f"preempt_on must be one of {PREEMPT_ON}, got {on!r}")
        self.received: float | None = None
        self._previous: Handler = None
        self._installed = False
        if on == "sigterm":
            if threading.current_thread() is threading.main_thread():
                self._previous = signal.signal(signal.SIGTERM, self._handle)
                self._installed = True
            else:
                logger.info("not on the main thread: no SIGTERM handler installed (call ckpt.preempt() on notice)")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = time.monotonic()
            logger.warning("SIGTERM: the version in flight is finished at the next hook, then the process exits")

    @property
    def pending(self) -> bool:
        """True once a SIGTERM arrived and was not handed on yet."""
        return self.received is not None and self._installed

    def uninstall(self) -> Handler:
        """Put the program's own handler back (main thread only); return it."""
        previous = self._previous
        if self._installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            self._installed = False
        return previous

    def hand_on(self) -> None:
        """Give the received SIGTERM to what the program had: default (terminate), ignore, or its handler."""
        previous = self.uninstall()
        if callable(previous):
            previous(signal.SIGTERM, None)
        elif previous in (None, signal.SIG_DFL):
            if signal.getsignal(signal.SIGTERM) == self._handle:  # not the main thread: cannot restore the default
                os._exit(128 + signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the default action now: terminated by SIGTERM, as without us
