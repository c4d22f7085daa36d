"""What one step's training state is, how it is captured and how it is loaded back.

Two parts, captured at different moments: the *flat state* (parameters and optimizer state
tensors, which only ``optimizer.step()`` changes) is read lazily, in partitions, during the next
iteration; the *eager state* (buffers, optimizer scalars, RNG states, ``data`` objects, param
groups and ``stateful`` objects) is small and copied at once, each part at its own moment.
Non-tensors go into the version's JSON ``meta`` through :mod:`asymcheck.state.encode`; nothing is
pickled. When each part is taken: the table in ``docs/guides/checkpointer.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from asymcheck.errors import StateMismatchError, UnsupportedStateError
from asymcheck.state import dtensors, loaders, rng
from asymcheck.state.capture import Capture, Moment
from asymcheck.state.encode import decode, encode
from asymstore.format.pieces import LAYOUT_KEY
from asymstore.format.tensors import host_copy

logger = logging.getLogger(__name__)

__all__ = ["FORMAT", "Capture", "CheckedStateful", "Moment", "Stateful", "TrainingState", "check_states"]

FORMAT = 1


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict`` (scheduler, GradScaler, sampler)."""

    def state_dict(self) -> Any:
        """Return the object's state."""
        ...

    def load_state_dict(self, state: Any) -> Any:
        """Restore the object's state."""
        ...


@runtime_checkable
class CheckedStateful(Stateful, Protocol):
    """A :class:`Stateful` that can tell whether a state fits it before anything is loaded.

    A resume calls ``check_state_dict`` of every such ``stateful``/``data`` object before it loads the
    model, the optimizer or any object, so a state that does not fit (another dataset, another seed)
    is refused while the live objects are untouched.
    """

    def check_state_dict(self, state: Any) -> None:
        """Raise :class:`asymcheck.errors.StateMismatchError` when ``state`` does not fit this object."""
        ...


def check_states(kind: str, live: Mapping[str, Stateful], states: Mapping[str, Any]) -> None:
    """Ask each object of ``live`` whether its decoded state in ``states`` fits it, before anything is loaded.

    Raises:
        StateMismatchError: a StatefulDataLoader's generators do not match, or a :class:`CheckedStateful` refuses.
    """
    for name, state in states.items():
        obj = live[name]
        loaders.check(f"{kind}[{name!r}]", obj, state)
        if isinstance(obj, CheckedStateful):
            obj.check_state_dict(state)


def _copy_all(tensors: Mapping[str, torch.Tensor], into: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        into[name] = host_copy(tensor)


def _param_indices(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in ``state_dict`` index order."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class TrainingState:
    """The model, optimizer and stateful objects whose state makes up one version.

    Args:
        model: the module trained.
        optimizer: its optimizer.
        stateful: name -> object with ``state_dict``/``load_state_dict``,
            captured after the loop's own bookkeeping (LR scheduler, GradScaler, counters).
        data: name -> object with ``state_dict``/``load_state_dict``, captured
            when the step returns (data loaders and samplers that advance when a batch is drawn).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 stateful: Mapping[str, Stateful] | None = None, data: Mapping[str, Stateful] | None = None) -> None:
        """Keep references to the live objects."""
        self.model = model
        self.optimizer = optimizer
        self.stateful: dict[str, Stateful] = _checked("stateful", stateful)
        self.data: dict[str, Stateful] = _checked("data", data)
        both = set(self.stateful) & set(self.data)
        if both:
            raise ValueError(f"names in both stateful= and data=: {sorted(both)}")
        self._fsdp2 = dtensors.is_fsdp2(model)
        self._layouts = dtensors.LayoutRecorder()
        self.touched = False
        """Whether the last :meth:`load` got past its checks and began to load into the live objects."""

    # -- capture ---------------------------------------------------------

    def signature(self) -> tuple[int, ...]:
        """Identities of every parameter, buffer and param group: changes when any is added or replaced.

        FSDP2 registers unsharded parameters in its modules around forward and
        backward: there the model's parameters count by number, and their
        identities are those of the optimizer's (sharded) parameters.
        """
        params = self.model.parameters()
        sig: list[int] = [sum(1 for _ in params)] if self._fsdp2 else [id(t) for t in params]
        sig.append(-1)
        sig += [id(t) for t in self.model.buffers()]
        for group in self.optimizer.param_groups:
            sig.append(-2)
            sig += [id(p) for p in group["params"]]
        return tuple(sig)

    def capture_moment(self) -> Moment:
        """Take the RNG states and the ``data`` objects' states now."""
        tensors: dict[str, torch.Tensor] = {}
        rng_meta = rng.capture(tensors)
        data = {name: encode(loaders.state_dict(obj), f"data/{_safe(name)}", tensors)
                for name, obj in self.data.items()}
        for name, t in list(tensors.items()):
            if name.startswith("data/"):
                tensors[name] = host_copy(t)
        return Moment({"rng": rng_meta, "data": data}, tensors)

    def capture_step(self, moment: Moment | None = None) -> Capture:
        """Capture what is fixed right after ``optimizer.step()``: flat refs, buffers, the moment.

        Args:
            moment: the RNG and data states taken when the step returned
                (default: now).
        """
        cap = Capture(signature=self.signature())
        owners: list[torch.Tensor | None] = []
        counters: list[torch.Tensor] = []
        lazy: dict[str, torch.Tensor] = {}
        eager: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        extra: dict[str, Any] = {}
        seen: dict[int, str] = {}
        model_params: set[int] = set()
        for key, value in self.model.state_dict(keep_vars=True).items():
            name = f"model/{key}"
            if not isinstance(value, torch.Tensor):
                extra[key] = encode(value, f"model-extra/{key}", eager)
                continue
            if id(value) in seen:
                aliases[key] = seen[id(value)]
                continue
            seen[id(value)] = key
            if dtensors.is_dtensor(value):  # its local shard is what this rank holds and copies
                cap.layouts[name] = dtensors.layout_of(value, name)
            if isinstance(value, torch.nn.Parameter):
                model_params.add(id(value))
                lazy[name] = dtensors.local_of(value)
                owners.append(value)
                counters.append(value)
            else:
                eager[name] = dtensors.local_of(value)
        params = _param_indices(self.optimizer)
        outside = {}
        for i, p in enumerate(params):
            if id(p) not in model_params and id(p) not in seen:
                lazy[f"optim/param/{i}"] = dtensors.local_of(p)
                owners.append(p)
                counters.append(p)
                if dtensors.is_dtensor(p):
                    cap.layouts[f"optim/param/{i}"] = dtensors.layout_of(p, f"optim/param/{i}")
                outside[str(i)] = f"optim/param/{i}"
        opt_sd = self.optimizer.state_dict()
        opt_tensors: dict[str, torch.Tensor] = {}
        state_tree = encode(opt_sd["state"], "optim/state", opt_tensors)
        for name, tensor in opt_tensors.items():
            lazy[name] = dtensors.local_of(tensor)
            owners.append(None)
            counters.append(tensor)
            if dtensors.is_dtensor(tensor):  # AdamW's moments of a DTensor parameter
                cap.layouts[name] = dtensors.layout_of(tensor, name)
        cap.names = list(lazy)
        cap.sources = list(lazy.values())
        cap.owners = owners
        cap.counters = counters
        _copy_all(eager, cap.eager)
        cap.meta = {
            "asymcheck": {"format": FORMAT},
            "model": {"aliases": aliases, "extra": extra},
            "optimizer": {
                "state": state_tree,
                "param_shapes": [list(p.shape) for p in params],
                "param_dtypes": [str(p.dtype).removeprefix("torch.") for p in params],
                "outside_params": outside,
            },
        }
        (moment or self.capture_moment()).apply(cap)
        return cap

    def capture_next(self, cap: Capture) -> None:
        """Capture what may change after the step but before the next one: param groups, stateful.

        The caller must first re-capture (``capture_step(moment)``) if
        ``signature()`` changed since ``cap`` was taken (parameters added).
        """
        eager: dict[str, torch.Tensor] = {}
        groups = encode(self.optimizer.state_dict()["param_groups"], "optim/param_groups", eager)
        cap.meta["optimizer"]["param_groups"] = groups
        cap.meta["stateful"] = {name: encode(loaders.state_dict(obj), f"stateful/{_safe(name)}", eager)
                                for name, obj in self.stateful.items()}
        _copy_all(eager, cap.eager)

    def capture_all(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Capture everything now, synchronously (for a final or one-off save)."""
        cap = self.capture_step()
        self.capture_next(cap)
        tensors = dict(cap.eager)
        for name, src in zip(cap.names, cap.sources, strict=True):
            tensors[name] = host_copy(src)
        layouts = self.layout_meta(tensors, cap)
        if layouts is not None:
            cap.meta[LAYOUT_KEY] = layouts
        return tensors, cap.meta

    def layout_meta(self, tensors: Mapping[str, torch.Tensor], cap: Capture) -> dict[str, Any] | None:
        """``meta["layout"]`` of a version holding ``tensors`` (see :mod:`asymstore.format.pieces`), or None."""
        return self._layouts.meta(cap.layouts)

    # -- load ------------------------------------------------------------

    def check_fit(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Check that a version fits the live objects, loading nothing (``tensors`` may be on the meta device).

        Raises:
            StateMismatchError: it does not fit.
        """
        self.prepare(tensors, meta)

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """The model's stored tensors as the checkpoint names them (``model/<key>``, aliases left out), detached."""
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, value in self.model.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                if type(value) in (torch.Tensor, torch.nn.Parameter):  # no subclass: its memory may not be its own
                    out[f"model/{key}"] = value.detach()
                elif dtensors.is_dtensor(value):  # the shard this rank holds
                    out[f"model/{key}"] = dtensors.local_of(value)
        return out

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's existing state tensors as the checkpoint names them (``optim/state/...``); plain ones only.

        Empty before the first step (AdamW creates its moments then).
        """
        found: dict[str, torch.Tensor] = {}
        encode(self.optimizer.state_dict()["state"], "optim/state", found)
        return {name: t.detach() for name, t in found.items() if type(t) is torch.Tensor}

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Check that the checkpoint fits, then load it into the live objects.

        Raises:
            StateMismatchError: names, shapes, dtypes, param groups or stateful
                names differ; nothing was loaded.
        """
        self.touched = False
        apply = self.prepare(tensors, meta)
        self.touched = True
        apply()

    def prepare(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Callable[[], None]:
        """Check that the checkpoint fits, every part of it, and return what loads it into the live objects.

        Nothing is loaded until the returned function runs: a mismatch found here (names, shapes,
        dtypes, param groups, a :class:`CheckedStateful` refusing its state) leaves every live
        object as it was.

        Raises:
            StateMismatchError: the checkpoint does not fit.
        """
        info = meta.get("asymcheck")
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise StateMismatchError(f"not an asymcheck checkpoint of format {FORMAT}: {info!r}")
        try:
            tensors = dtensors.as_global(tensors, meta, self.live_tensors())
            model_sd = self._check_model(tensors, meta["model"])
            opt_sd, outside = self._check_optimizer(tensors, meta["optimizer"])
            states = self._check_stateful(tensors, meta.get("stateful", {}))
            datas = _check_named("data", self.data, tensors, meta.get("data", {}))
            rng_meta = meta["rng"]
            check_states("stateful", self.stateful, states)
            check_states("data", self.data, datas)
        except (KeyError, TypeError, UnsupportedStateError) as exc:
            if isinstance(exc, StateMismatchError):
                raise
            raise StateMismatchError(f"checkpoint is incomplete or malformed: {exc!r}") from exc

        def apply() -> None:
            with torch.no_grad():
                self.model.load_state_dict(model_sd, strict=True)
                for p, value in outside:
                    p.copy_(value)
            self.optimizer.load_state_dict(opt_sd)
            for name, state in states.items():
                loaders.load_state_dict(self.stateful[name], state)
            for name, state in datas.items():
                loaders.load_state_dict(self.data[name], state)
            rng.restore(rng_meta, tensors)

        return apply

    def _check_model(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> dict[str, Any]:
        live = self.model.state_dict()
        saved: dict[str, Any] = {}
        for name, tensor in tensors.items():
            if name.startswith("model/"):
                saved[name.removeprefix("model/")] = tensor
        for alias, canonical in meta["aliases"].items():
            saved[alias] = saved[canonical]
        for key, tree in meta["extra"].items():
            saved[key] = decode(tree, tensors)
        missing = sorted(set(live) - set(saved))
        unexpected = sorted(set(saved) - set(live))
        if missing or unexpected:
            raise StateMismatchError(f"model keys differ: missing from checkpoint {missing[:5]}"
                                     f"{'...' if len(missing) > 5 else ''}, not in model {unexpected[:5]}"
                                     f"{'...' if len(unexpected) > 5 else ''}")
        for key, value in live.items():
            if isinstance(value, torch.Tensor):
                got = saved[key]
                if not isinstance(got, torch.Tensor) or got.shape != value.shape or got.dtype != value.dtype \
                        or not dtensors.same_kind(value, got):
                    desc = dtensors.describe(got) if isinstance(got, torch.Tensor) else type(got).__name__
                    raise StateMismatchError(f"model/{key}: checkpoint has {desc}, "
                                             f"model has {dtensors.describe(value)}")
        return saved

    def _check_optimizer(self, tensors: Mapping[str, torch.Tensor],
                         meta: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        groups = decode(meta["param_groups"], tensors)
        live_groups = self.optimizer.param_groups
        if len(groups) != len(live_groups):
            raise StateMismatchError(f"optimizer has {len(live_groups)} param groups, checkpoint {len(groups)}")
        for i, (g, lg) in enumerate(zip(groups, live_groups, strict=True)):
            if len(g["params"]) != len(lg["params"]):
                raise StateMismatchError(f"param group {i}: optimizer has {len(lg['params'])} params, "
                                         f"checkpoint {len(g['params'])}")
        params = _param_indices(self.optimizer)
        shapes, dtypes = meta["param_shapes"], meta["param_dtypes"]
        if len(shapes) != len(params):
            raise StateMismatchError(f"optimizer has {len(params)} params, checkpoint {len(shapes)}")
        for i, p in enumerate(params):
            if list(p.shape) != shapes[i] or str(p.dtype).removeprefix("torch.") != dtypes[i]:
                raise StateMismatchError(f"optimizer param {i}: checkpoint has {shapes[i]} {dtypes[i]}, "
                                         f"live {list(p.shape)} {p.dtype}")
        outside = []
        for idx, name in meta["outside_params"].items():
            value = tensors[name]
            outside.append((params[int(idx)], value))
        return {"state": decode(meta["state"], tensors), "param_groups": groups}, outside

    def live_tensors(self) -> list[object]:
        """The model's and optimizer's tensors (their device meshes place sharded tensors on load)."""
        return [*self.model.state_dict(keep_vars=True).values(), *_param_indices(self.optimizer)]

    def _check_stateful(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> dict[str, Any]:
        return _check_named("stateful", self.stateful, tensors, meta)


RENAMED: dict[str, str] = {"trainer_state": "hf.trainer_state", "lr_scheduler": "hf.scheduler"}
"""Stateful names of earlier releases' integrations -> today's (``<framework>.<what>[.<i>]``).

A version holding an old name restores into the live object of the new name, when the live
objects have the new name and not the old one (a user's own ``"lr_scheduler"`` is left alone).
"""


def renamed(meta: Mapping[str, Any], live: Mapping[str, object]) -> dict[str, Any]:
    """``meta`` (name -> state of a version) with the names of :data:`RENAMED` given as ``live`` names them."""
    out: dict[str, Any] = {}
    for name, tree in meta.items():
        new = RENAMED.get(name)
        use = new if new is not None and name not in live and new in live and new not in meta else name
        out[use] = tree
    return out


def _check_named(kind: str, live: Mapping[str, Stateful], tensors: Mapping[str, torch.Tensor],
                 meta: Mapping[str, Any]) -> dict[str, Any]:
    if kind == "stateful":
        meta = renamed(meta, live)
    if set(meta) != set(live):
        raise StateMismatchError(f"{kind} objects differ: checkpoint has {sorted(meta)}, live {sorted(live)}")
    return {name: decode(tree, tensors) for name, tree in meta.items()}


def _checked(kind: str, objs: Mapping[str, Stateful] | None) -> dict[str, Stateful]:
    out = dict(objs or {})
    for name, obj in out.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{kind} keys must be non-empty str, got {name!r}")
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"{kind}[{name!r}] has no state_dict/load_state_dict")
    return out


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in name) or "_"
