"""Where the snapshot protocol hooks into a DeepSpeed engine, without patching it.

``engine.step()`` wraps the torch optimizer's step inside DeepSpeed's (ZeRO) optimizer; ZeRO-3 calls
the inner step once per parameter sub-group. So *step pre* (seal the previous version) is the inner
optimizer's first step pre-hook of an engine step; *step done* (RNG states, ``data`` objects) its
step post-hook; *step post* (open the new version) the first forward pre-hook after the step,
prepended on the root module so it runs before ZeRO-3 gathers any parameter (counters, scheduler and
parameters are final by then). A loop that calls the root's submodules directly never runs the root's
forward: the first forward pre-hook of any module delivers it then, and failing that the first step
pre-hook of the next engine step (told apart from ZeRO-3's next sub-group by ``engine.global_steps``).
Forward and post-accumulate-grad hooks drive the partitions as in the plain adapter.

Guide: ``docs/guides/deepspeed.md`` (What a version holds).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from asymcheck.errors import UnsupportedStateError
from asymcheck.snapshot.hooks import Callback, ForwardCallback, HookSet

logger = logging.getLogger(__name__)


def inner_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose ``step`` DeepSpeed's optimizer (ZeRO, bf16, fp16 or none) calls.

    Raises:
        UnsupportedStateError: the engine has no torch optimizer inside.
    """
    opt = getattr(engine, "optimizer", None)
    for _ in range(5):
        if isinstance(opt, torch.optim.Optimizer):
            return opt
        opt = getattr(opt, "optimizer", None)
    raise UnsupportedStateError("the DeepSpeed engine has no torch optimizer to hook (engine.optimizer...optimizer)")


class DeepSpeedHooks(HookSet):
    """The plain adapter's hooks, with the step hooks placed for a DeepSpeed engine (see the module docstring).

    Args:
        engine: the DeepSpeed engine.
        on_forward: called at each forward pre-hook (with whether it is a training forward).
        on_grad: called after a gradient is accumulated into a parameter.
        on_step_pre: called once per engine step, before the optimizer changes anything.
        on_step_post: called once the engine step is complete (at the next forward, or ``settle``).
        on_step_done: called after each inner optimizer step (ZeRO-3: once per sub-group).
    """

    def __init__(self, engine: Any, *, on_forward: ForwardCallback, on_grad: Callback, on_step_pre: Callback,
                 on_step_post: Callback, on_step_done: Callback | None = None) -> None:
        """Register every hook."""
        self._pre_cb = on_step_pre
        self._post_cb = on_step_post
        self._done_cb = on_step_done
        self._engine = engine
        self.stepping = False  # inside an engine step (the inner pre-hook fired)
        self.stepped = False  # the inner step ran; the post callback is due
        self._stepping_at: int | None = None  # engine.global_steps when the engine step in progress began
        super().__init__(engine.module, inner_optimizer(engine), on_forward=on_forward, on_grad=on_grad,
                         on_step_pre=self._inner_pre, on_step_post=self._inner_post)
        self._root: RemovableHandle | None = engine.module.register_forward_pre_hook(self._root_pre, prepend=True)

    def _inner_pre(self) -> None:
        at = getattr(self._engine, "global_steps", None)
        if self.stepped and at != self._stepping_at:  # a new engine step, and no forward delivered the last one
            self.settle()
        if not self.stepping:
            self.stepping = True
            self._stepping_at = at
            self._pre_cb()

    def _inner_post(self) -> None:
        self.stepped = True
        if self._done_cb is not None:
            self._done_cb()

    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        self.settle()

    def _forward_hook(self, module: torch.nn.Module, args: Any) -> None:
        self.settle()  # a forward that bypassed the root module (its children called directly)
        super()._forward_hook(module, args)

    def settle(self) -> None:
        """Deliver a pending step post (the first forward after a step does this on its own)."""
        if self.stepped:
            self.stepping = self.stepped = False
            self._post_cb()

    def remove(self) -> None:
        """Remove every hook."""
        if self._root is not None:
            self._root.remove()
            self._root = None
        super().remove()
