"""A TorchTitan config registry for the entry-point tests: the debug model with ``AsymCheckManager`` selected.

``torchrun ... -m torchtitan.train --module tests.support.titan_config --config llama3_debugmodel_asymcheck``
(TorchTitan imports ``--module`` and calls ``--config``; the other options are TorchTitan's own CLI overrides).
Imported only by TorchTitan's config manager (it needs the llama3 model, so CUDA and triton).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

from asymcheck.torchtitan import AsymCheckManager


class KillingManager(AsymCheckManager):
    """The manager, with a fault injected: SIGKILL right after ``save(kill_at)`` (tests only)."""

    @dataclass(kw_only=True, slots=True)
    class Config(AsymCheckManager.Config):
        kill_at: int = -1
        """The step after whose ``save`` the process kills itself (-1: never)."""

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        taken = super()._save(curr_step, last_step)
        if curr_step == self.config.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return taken


def llama3_debugmodel_asymcheck() -> Any:
    """TorchTitan's ``llama3_debugmodel`` with a version every step (``--checkpoint.kill_at N``: killed there)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.checkpoint = KillingManager.Config(enable=True, interval=1, folder="checkpoint", keep_latest_k=3,
                                              last_save_in_hf=True)
    config.validator.enable = False  # its dataset is c4's validation split, on the Hub
    config.training.disable_cuda_graphs = True  # refused by the manager otherwise (docs/guides/torchtitan.md)
    return config
