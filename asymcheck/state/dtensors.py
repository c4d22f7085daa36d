"""DTensor state (FSDP2's ``fully_shard``) under the Checkpointer: copy the local shards, record where they sit.

A DTensor parameter or optimizer state tensor is captured as its *local* shard, which FSDP2 keeps
in place between steps; edits are checked on the DTensor's own version counter. Nothing is
captured inside a forward (FSDP2 swaps in unsharded parameters there), so the model's signature
counts parameters instead of naming them (:mod:`asymcheck.state.trainstate`). Each shard's
:class:`~asymstore.format.pieces.TensorLayout` goes into ``meta["layout"]``; on resume the pieces
are wrapped back into DTensors on the live mesh and loaded through ``load_state_dict``. Only
``Shard(d)`` and ``Replicate()`` are supported; anything else is refused with
:class:`~asymcheck.errors.UnsupportedModelError`.

The user's view: docs/guides/fsdp2.md.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from asymcheck.errors import StateMismatchError, UnsupportedModelError
from asymstore.errors import LayoutError
from asymstore.format.pieces import LAYOUT_KEY, MeshInfo, TensorLayout, layout_meta, parse_layout_meta
from asymstore.format.tensors import dtype_name

logger = logging.getLogger(__name__)


@functools.cache
def _dtensor_types() -> tuple[Any, Any, Any] | None:
    """(DTensor, Shard, Replicate), or None without torch.distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Shard, Replicate


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (a DTensor parameter included)."""
    types = _dtensor_types()
    return types is not None and isinstance(t, types[0])


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The memory this rank holds of ``t``: a DTensor's local tensor, or ``t`` itself (detached)."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local().detach()  # type: ignore[attr-defined, no-any-return]
    return t.detach()


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) manages a module of ``model``.

    FSDP2 swaps its modules' registered parameters between the sharded
    DTensors and unsharded plain parameters around forward and backward.
    """
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _placements(t: Any) -> tuple[str, ...]:
    types = _dtensor_types()
    assert types is not None
    _, shard, replicate = types
    out = []
    for p in t.placements:
        if type(p) is shard:
            out.append(f"S({p.dim})")
        elif type(p) is replicate:
            out.append("R")
        else:
            raise UnsupportedModelError(f"placement {p!r}: only Shard(d) and Replicate() DTensors are supported")
    return tuple(out)


_MESHES: dict[int, tuple[Any, MeshInfo]] = {}  # id -> (mesh, its info): meshes are few and live as long as the job


def _mesh_info(mesh: Any) -> MeshInfo:
    known = _MESHES.get(id(mesh))
    if known is not None and known[0] is mesh:
        return known[1]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedModelError("a DTensor on a device mesh this rank is not part of")
    info = MeshInfo(tuple(int(n) for n in mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                    tuple(int(c) for c in coordinate))
    _MESHES[id(mesh)] = (mesh, info)
    return info


_LAYOUTS: dict[int, tuple[weakref.ref[torch.Tensor], TensorLayout]] = {}  # id -> (the DTensor, its piece)


def layout_of(t: torch.Tensor, name: str = "tensor") -> TensorLayout:
    """Where this rank's piece of ``t`` sits in the global tensor (a plain tensor: held whole).

    A DTensor's piece is remembered while it lives (it is asked every step)
    and worked out again if its local tensor changed shape.

    Raises:
        UnsupportedModelError: unsupported placements, or a local tensor that
            is not the piece its placements give (padding, a custom layout).
    """
    if not is_dtensor(t):
        return TensorLayout.whole(t.shape, dtype_name(t.dtype))
    dt: Any = t
    known = _LAYOUTS.get(id(t))
    if known is not None and known[0]() is t and tuple(dt._local_tensor.shape) == known[1].shape:
        return known[1]
    layout = _layout_of(dt, name)
    key = id(t)
    _LAYOUTS[key] = (weakref.ref(t, lambda _, key=key: _LAYOUTS.pop(key, None)), layout)  # type: ignore[misc]
    return layout


def _layout_of(dt: Any, name: str) -> TensorLayout:
    try:
        layout = TensorLayout.sharded(dt.shape, dtype_name(dt.dtype), _mesh_info(dt.device_mesh), _placements(dt))
    except (LayoutError, UnsupportedModelError) as exc:
        raise UnsupportedModelError(f"{name}: {exc}") from None
    local = dt._local_tensor
    if tuple(local.shape) != layout.shape:
        raise UnsupportedModelError(f"{name}: local tensor {tuple(local.shape)} is not the piece {layout.shape} "
                                    f"that {list(layout.placements)} give this rank")
    return layout


def check_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse tensors the lazy copy cannot read: subclasses other than DTensor, unsupported placements.

    Raises:
        UnsupportedModelError: naming the first such tensor and its class or placement.
    """
    named = [(f"model/{k}", v) for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)]
    named += [(f"optimizer param {i}", p) for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])]
    for key, state in optimizer.state.items():
        named += [(f"optimizer state {k!r} of param {getattr(key, 'shape', '?')}", v)
                  for k, v in state.items() if isinstance(v, torch.Tensor)]
    for name, t in named:
        if is_dtensor(t):
            layout_of(t, name)
        elif type(t.detach()) is not torch.Tensor:
            cls = type(t.detach())
            raise UnsupportedModelError(
                f"{name} is a {cls.__module__}.{cls.__qualname__}, a tensor subclass: the Checkpointer copies plain "
                "tensors and DTensors (FSDP2) only; use DDP, FSDP2, DeepSpeed ZeRO through "
                "asymcheck.deepspeed.attach, or torch.distributed.checkpoint")


class LayoutRecorder:
    """``meta["layout"]`` of each version (see :mod:`asymstore.format.pieces`), rebuilt only when the pieces change.

    The pieces of a model's DTensors are the same from step to step, so the
    JSON of the previous version is handed on (it is only read afterwards);
    the step pays a dictionary comparison, not a rebuild.
    """

    def __init__(self) -> None:
        """Nothing recorded yet."""
        self._pieces: dict[str, TensorLayout] | None = None
        self._doc: dict[str, Any] = {}

    def meta(self, pieces: Mapping[str, TensorLayout]) -> dict[str, Any]:
        """The layout of a version whose sharded tensors are ``pieces`` (every other one held whole)."""
        if self._pieces != pieces:
            self._pieces = dict(pieces)
            self._doc = layout_meta(pieces)
        return self._doc


def live_meshes(tensors: Iterable[object]) -> list[MeshInfo]:
    """The distinct device meshes of the DTensors among ``tensors``, as seen from this rank."""
    return [_mesh_info(mesh) for mesh in _live_meshes(tensors).values()]


def _live_meshes(tensors: Iterable[object]) -> dict[tuple[tuple[int, ...], tuple[int, ...]], Any]:
    out: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
    for t in tensors:
        if is_dtensor(t):
            mesh: Any = t.device_mesh  # type: ignore[attr-defined]
            info = _mesh_info(mesh)
            out.setdefault((info.shape, info.ranks), mesh)
    return out


def as_global(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
              live: Iterable[object]) -> Mapping[str, torch.Tensor]:
    """Wrap the stored local pieces that ``meta["layout"]`` places on a mesh back into DTensors on the live mesh.

    Args:
        tensors: the version's tensors (local pieces; may be on the meta device).
        meta: the version's meta.
        live: the live model's and optimizer's tensors (their meshes are used).

    Raises:
        StateMismatchError: the layout is malformed, the mesh is not live, or
            this rank's piece now would be another one (another world size or mesh).
    """
    doc = meta.get(LAYOUT_KEY)
    if not isinstance(doc, dict) or not any(isinstance(e, dict) and e.get("mesh") is not None
                                            for e in (doc.get("tensors") or {}).values()):
        return tensors
    try:
        layouts = parse_layout_meta(doc)
    except LayoutError as exc:
        raise StateMismatchError(f"malformed layout in the checkpoint: {exc}") from None
    types = _dtensor_types()
    assert types is not None
    dtensor, shard, replicate = types
    meshes = _live_meshes(live)
    out = dict(tensors)
    for name, saved in layouts.items():
        if saved.mesh is None or name not in tensors:
            continue
        mesh = meshes.get((saved.mesh.shape, saved.mesh.ranks))
        if mesh is None:
            raise StateMismatchError(f"{name} was saved sharded on a mesh of shape {list(saved.mesh.shape)} over "
                                     f"ranks {list(saved.mesh.ranks)[:8]}; the live model has no such mesh "
                                     "(versions of another world size are resharded from a multi-rank root only)")
        now = _mesh_info(mesh).coordinate
        local = tensors[name]
        if now != saved.mesh.coordinate or tuple(local.shape) != saved.shape:
            raise StateMismatchError(f"{name}: this rank held the piece at mesh coordinate "
                                     f"{list(saved.mesh.coordinate)} and is at {list(now)} now")
        placements = [replicate() if p == "R" else shard(int(p[2:-1])) for p in saved.placements]
        stride = [1] * len(saved.global_shape)
        for d in range(len(stride) - 2, -1, -1):
            stride[d] = stride[d + 1] * max(1, saved.global_shape[d + 1])
        out[name] = dtensor.from_local(local, mesh, placements, run_check=False,
                                       shape=torch.Size(saved.global_shape), stride=tuple(stride))
    return out


def same_kind(live: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether both or neither are DTensors (a whole tensor does not load into a sharded one, or back)."""
    return is_dtensor(live) == is_dtensor(saved)


def describe(t: torch.Tensor) -> str:
    """Shape, dtype and, for a DTensor, its placements (for error messages)."""
    placed = f" DTensor {list(_placements(t))}" if is_dtensor(t) else ""
    return f"{tuple(t.shape)} {t.dtype}{placed}"


def address_of(t: torch.Tensor) -> int:
    """The data address of the memory this rank holds of ``t`` (a DTensor's local tensor)."""
    return local_of(t).data_ptr() if is_dtensor(t) else t.data_ptr()
