"""Registering (and keeping up to date) the hooks that drive the snapshot protocol.

:class:`Driver` holds the protocol's entry points; :class:`Hooks` is what registers them on a
framework's events (:class:`HookSet` for a plain loop). An adapter whose framework steps otherwise
gives ``Checkpointer(hooks=factory)`` a factory that takes the Driver and returns its Hooks
(docs/guides/checkpointer.md, "Driving the Checkpointer from other hooks").
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger(__name__)

Callback = Callable[[], None]
ForwardCallback = Callable[[bool], None]


@dataclass(frozen=True)
class Driver:
    """The entry points of one Checkpointer's snapshot protocol, for the hooks that drive it.

    Each is called from the training thread, at the event its name says; between two
    ``before_step`` calls come exactly one ``after_step`` (the step is complete) and any number of
    the others. ``after_step`` may come late (DeepSpeed delivers it at the next forward), and
    then ``step_returned`` must come when the optimizer's own step returns.

    Attributes:
        on_forward: a forward pre-hook fired; the argument says whether it is a training forward
            (grad enabled, module in training mode) or a validation one (which drives nothing).
        on_grad: a gradient was accumulated into a parameter.
        before_step: the optimizer is about to step: the previous version is sealed (the stall).
        after_step: the optimizer step is complete (counters, scheduler, parameters final): the
            next version opens.
        step_returned: the optimizer's own step returned but ``after_step`` is delivered later:
            the RNG states and ``data`` objects of the next version are taken now.
    """

    on_forward: ForwardCallback
    on_grad: Callback
    before_step: Callback
    after_step: Callback
    step_returned: Callback


class Hooks(Protocol):
    """What a ``hooks=`` factory returns: the registered hooks of one Checkpointer."""

    def refresh(self) -> int:
        """Hook modules and parameters added since the last call; return how many."""
        ...

    def settle(self) -> None:
        """Deliver a step completion that is still pending (hooks that deliver ``after_step`` late)."""
        ...

    def remove(self) -> None:
        """Remove every hook."""
        ...


HooksFactory = Callable[[Driver], Hooks]
"""Builds and registers the hooks that call a :class:`Driver` (``Checkpointer(hooks=...)``)."""


class HookSet:
    """The hooks of the protocol: forward, grad, and the optimizer's step pre/post hooks.

    Forward pre-hooks go on every submodule, post-accumulate-grad hooks on
    every trainable parameter. ``refresh`` hooks modules and parameters added (or unfrozen) since the last call.

    Under ``torch.compile`` the forward and grad hooks run eagerly, never traced: each is wrapped in
    ``torch.compiler.disable``, so a compiled graph breaks at a hooked submodule and the hook runs as
    Python, every call, with the Checkpointer's own state (traced, Dynamo would inline the snapshot
    protocol into the graph and break at whatever inside it it cannot trace). In eager mode the
    wrapper costs well under a microsecond per call.

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
        self._forward: Callable[[torch.nn.Module, Any], None] = torch.compiler.disable(  # type: ignore[no-untyped-call]
            self._forward_hook)
        self._grad: Callable[[torch.Tensor], None] = torch.compiler.disable(  # type: ignore[no-untyped-call]
            self._grad_hook)
        self._handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: on_step_pre()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: on_step_post()),
        ]
        self.refresh()

    @classmethod
    def driving(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, driver: Driver) -> HookSet:
        """The plain loop's hooks: forward and grad hooks, the optimizer's step pre- and post-hooks."""
        return cls(model, optimizer, on_forward=driver.on_forward, on_grad=driver.on_grad,
                   on_step_pre=driver.before_step, on_step_post=driver.after_step)

    def settle(self) -> None:
        """Nothing is ever pending: the step post-hook delivers ``after_step`` when the step returns."""

    def _known(self, obj: Any) -> bool:
        entry = self._hooked.get(id(obj))
        return entry is not None and entry[0]() is obj

    def refresh(self) -> int:
        """Hook modules and trainable parameters not hooked yet; return how many were added."""
        added = 0
        for module in self.model.modules():
            if not self._known(module):
                handle = module.register_forward_pre_hook(self._forward)
                self._hooked[id(module)] = (weakref.ref(module), handle)
                added += 1
        params = list(self.model.parameters())
        params += [p for g in self.optimizer.param_groups for p in g["params"]]
        for p in params:
            if p.requires_grad and not self._known(p):
                handle = p.register_post_accumulate_grad_hook(self._grad)  # type: ignore[no-untyped-call]
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


class StepHooks:
    """Only the optimizer's step pre- and post-hooks: nothing inside the model's forward or backward.

    For models compiled whole (``torch.compile(..., fullgraph=True)``, where a hook that breaks the
    graph is an error) or where a graph break per submodule costs more than the lazy copy saves: the
    version's copy is done in the step pre-hook (``PartitionOptions(partitioning="step")``), and its
    late state (param groups, scheduler, ``stateful``) is taken there too, before the step changes it.

    Args:
        optimizer: the optimizer whose step is hooked.
        driver: the Checkpointer's entry points.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, driver: Driver) -> None:
        """Register the two hooks."""
        self._handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: driver.before_step()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: driver.after_step()),
        ]

    def refresh(self) -> int:
        """Nothing to follow: the optimizer's own hooks see every parameter."""
        return 0

    def settle(self) -> None:
        """Nothing is ever pending."""

    def remove(self) -> None:
        """Remove both hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
