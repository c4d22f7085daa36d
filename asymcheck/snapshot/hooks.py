"""Registering (and keeping up to date) the hooks that drive the snapshot protocol."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger(__name__)

Callback = Callable[[], None]
ForwardCallback = Callable[[bool], None]


class HookSet:
    """The hooks of the protocol: forward, grad, and the optimizer's step pre/post hooks.

    Forward pre-hooks go on every submodule, post-accumulate-grad hooks on
    every trainable parameter. ``refresh`` hooks modules and parameters added (or unfrozen) since the last call.

    Args:
        model: the module whose submodules get forward pre-hooks.
        optimizer: the optimizer whose step is hooked (its parameters get grad hooks too).
        on_forward: called at each forward pre-hook with whether it is a training forward
            (grad enabled and the module in training mode) or not (validation).
        on_grad: called after a gradient is accumulated into a parameter.
        on_step_pre: called before ``optimizer.step()``.
        on_step_post: called after it.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, on_forward: ForwardCallback,
                 on_grad: Callback, on_step_pre: Callback, on_step_post: Callback) -> None:
        """Register every hook."""
        self.model = model
        self.optimizer = optimizer
        self._on_forward = on_forward
        self._on_grad = on_grad
        self._hooked: dict[int, tuple[weakref.ref[Any], RemovableHandle]] = {}
        self._handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: on_step_pre()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: on_step_post()),
        ]
        self.refresh()

    def _known(self, obj: Any) -> bool:
        entry = self._hooked.get(id(obj))
        return entry is not None and entry[0]() is obj

    def refresh(self) -> int:
        """Hook modules and trainable parameters not hooked yet; return how many were added."""
        added = 0
        for module in self.model.modules():
            if not self._known(module):
                handle = module.register_forward_pre_hook(self._forward_hook)
                self._hooked[id(module)] = (weakref.ref(module), handle)
                added += 1
        params = list(self.model.parameters())
        params += [p for g in self.optimizer.param_groups for p in g["params"]]
        for p in params:
            if p.requires_grad and not self._known(p):
                handle = p.register_post_accumulate_grad_hook(self._grad_hook)  # type: ignore[no-untyped-call]
                self._hooked[id(p)] = (weakref.ref(p), handle)
                added += 1
        if added:  # the model changed: forget entries of objects that are gone
            self._hooked = {k: v for k, v in self._hooked.items() if v[0]() is not None}
        return added

    def _forward_hook(self, module: torch.nn.Module, args: Any) -> None:
        self._on_forward(torch.is_grad_enabled() and module.training)

    def _grad_hook(self, param: torch.Tensor) -> None:
        self._on_grad()

    def remove(self) -> None:
        """Remove every hook."""
        for _, handle in self._hooked.values():
            handle.remove()
        for handle in self._handles:
            handle.remove()
        self._hooked.clear()
        self._handles.clear()
