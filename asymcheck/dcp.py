"""DCP's stager: the staging copy of ``dcp.async_save`` goes into reused host slots, off the training thread.

::

    stager = Stager(optimizer)                 # the copy overlaps the next forward and backward
    response = dcp.async_save(state, storage_writer=StorageWriter("ckpt"), async_stager=stager,
                              checkpoint_id=str(step))
    ...                                        # forward, backward: the copy runs meanwhile
    optimizer.step()                           # its step pre-hook waits for what is left of the copy
    response.upload_completion.result()        # before the next save (one save at a time per writer)
    stager.close()                             # after the last save

:class:`Stager` implements ``torch.distributed.checkpoint.staging.AsyncStager``. Each ``stage`` copies the
state dict's tensors into one slot of a fixed :class:`~asymcheck.snapshot.hostpool.HostPool` (allocated
once, reused) and hands DCP typed views of the slot. The tensors the optimizer owns (its parameters and
its state: what only ``optimizer.step()`` changes) are copied by the
:class:`~asymcheck.snapshot.copyengine.CopyEngine`'s thread while training goes on, and the optimizer's
step pre-hook waits for that copy to finish before the step may change them; every other tensor
(buffers, which a forward may change; RNG states) is copied inside ``stage``. Every background copy is
checked (the tensor's version counter, data address and a byte sample, as the Checkpointer's snapshot
checks its own): a tensor changed before its copy finished fails the save with
:class:`~asymcheck.errors.StagingError`, so nothing of it is written. A slot comes back once DCP drops
the staged views (its save is done); when none is free, ``stage`` waits (back-pressure), for at most
``slot_timeout_s``.

Guide: docs/guides/dcp.md ("The stager").
"""

from __future__ import annotations

import copy
import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from asymcheck.errors import InvalidOptionError, StagingError, UnsupportedModelError
from asymcheck.snapshot.copyengine import CopyEngine, CopyJob
from asymcheck.snapshot.hostpool import HostPool, HostSlot
from asymcheck.snapshot.version import sample_view, storage_need
from asymcheck.state.dtensors import is_dtensor, local_of
from asymstore.dcp.lent import lend
from asymstore.format.manifest import DTYPE_SIZES
from asymstore.format.tensors import dtype_name

logger = logging.getLogger(__name__)

__all__ = ["Stager", "StagerStats"]

StateDict = dict[str, Any]


@dataclass(frozen=True)
class StagerStats:
    """What a :class:`Stager` did so far.

    Attributes:
        stages: ``stage`` calls that took a copy (or began one).
        failed: of them, copies that failed their checks (their saves wrote nothing).
        bytes_staged: bytes of the newest stage.
        background_bytes: bytes copied by the copy engine's thread, over all stages.
        inline_bytes: bytes copied inside ``stage`` itself, over all stages.
        host_bytes: bytes the host slots hold (allocated once, reused).
        stage_s: seconds spent inside ``stage`` (the training thread), over all stages.
        step_wait_s: seconds the optimizer's step pre-hook waited for a copy, over all steps.
        slot_wait_s: of ``stage_s``, seconds spent waiting for a free slot (back-pressure).
    """

    stages: int
    failed: int
    bytes_staged: int
    background_bytes: int
    inline_bytes: int
    host_bytes: int
    stage_s: float
    step_wait_s: float
    slot_wait_s: float


class _Lease:
    """A slot lent to one stage: handed back once every staged view of it is gone."""

    def __init__(self, pool: HostPool, slot: HostSlot) -> None:
        self.pool, self.slot = pool, slot
        self._lock = threading.Lock()
        self._live = 1  # the stage itself holds one until it has registered every view
        self._returned = False

    def hold(self, view: torch.Tensor) -> None:
        with self._lock:
            self._live += 1
        weakref.finalize(view, self.drop)

    def drop(self) -> None:
        with self._lock:
            self._live -= 1
            done = self._live == 0 and not self._returned
            self._returned |= done
        if done:
            self.pool.release(self.slot)


@dataclass
class _Leaf:
    """One tensor of the state dict: where it is copied, and how."""

    path: str
    src: torch.Tensor
    lazy: bool  # copied by the engine's thread (the optimizer owns it), else inside stage()
    param: bool  # a parameter's memory (what ``p.data`` edits reach): byte-sampled
    counter: torch.Tensor  # whose version counter in-place edits move (a DTensor's own, else ``src``)
    dtensor: Any = None  # the DTensor ``src`` is the local tensor of (its staged copy is one too)


@dataclass
class _Pending:
    """A stage whose background copy is running."""

    future: Future[StateDict]
    lazy: list[int]
    leaves: list[_Leaf]
    versions: list[int]
    sampled: list[int]
    sample: torch.Tensor | None
    sample_ready: Any  # a CUDA event after the sample's copy to the host, or None
    slot: HostSlot


def _check_tensor(path: str, value: torch.Tensor) -> torch.Tensor:
    """The plain tensor to copy for ``value``.

    Raises:
        UnsupportedModelError: a tensor the staging copy cannot read safely.
    """
    if type(value) is torch.nn.Parameter:
        value = value.detach()  # the same memory and version counter, as a plain tensor
    if type(value) is not torch.Tensor:
        raise UnsupportedModelError(f"{path}: a {type(value).__name__} cannot be staged (plain tensors and "
                                    "DTensors only; ShardedTensor and other subclasses are not supported)")
    if value.layout != torch.strided or value.is_quantized or dtype_name(value.dtype) not in DTYPE_SIZES:
        raise UnsupportedModelError(f"{path}: a {value.layout} tensor of {value.dtype} cannot be staged")
    if value.device.type not in ("cpu", "cuda"):
        raise UnsupportedModelError(f"{path}: a tensor on {value.device} cannot be staged (CPU or CUDA only)")
    return value


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _owned_storages(optimizers: Sequence[torch.optim.Optimizer]) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """The storages of the parameters, and of the state tensors, of ``optimizers`` (what only their step changes)."""
    params: set[tuple[str, int]] = set()
    states: set[tuple[str, int]] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                p = local_of(p) if is_dtensor(p) else p
                if type(p) in (torch.Tensor, torch.nn.Parameter) and p.layout == torch.strided:
                    params.add(_storage_key(p))
        for state in opt.state.values():
            for v in state.values() if isinstance(state, Mapping) else ():
                v = local_of(v) if is_dtensor(v) else v
                if type(v) is torch.Tensor and v.layout == torch.strided:
                    states.add(_storage_key(v))
    return params, states


class Stager(AsyncStager):
    """DCP's ``AsyncStager`` over reused host slots; with an optimizer, the copy overlaps forward and backward.

    ``Stager(optimizer)``: ``stage`` returns a future, so ``dcp.async_save`` returns DCP's
    ``AsyncSaveResponse`` (``staging_completion``, ``upload_completion``). The optimizer's tensors are
    copied in the background through the next forward and backward; the optimizer's step pre-hook
    waits for what is left (the only stall); a copy that fails its checks fails the save, not the step.

    ``Stager()``: every tensor is copied inside ``stage`` (into the slots, no allocation per save) and
    ``dcp.async_save`` returns the upload's future, as with DCP's default stager.

    Only DCP's default thread executor is supported (``async_checkpointer_type=THREAD``, the default):
    the staged tensors are views of the host slots, read by DCP's upload thread.

    Args:
        optimizer: the optimizer (or optimizers) whose ``step`` must not run before the copy finished;
            their parameters and state tensors are copied in the background. None: copy everything in
            ``stage``.
        slots: host slots (staged versions at once: the one being copied and those DCP still writes).
        pin: pin the slots (default: when some parameter of ``optimizer`` is on CUDA).
        slot_timeout_s: the longest ``stage`` waits for a free slot before it fails the save.

    Raises:
        InvalidOptionError: ``slots`` < 1, ``slot_timeout_s`` not positive, or ``optimizer`` not an optimizer.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None, *,
                 slots: int = 2, pin: bool | None = None, slot_timeout_s: float = 60.0) -> None:
        """Create the slots (allocated at the first stage) and hook the optimizer's step."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise InvalidOptionError(f"slots must be an int >= 1, got {slots!r}")
        if isinstance(slot_timeout_s, bool) or not isinstance(slot_timeout_s, int | float) \
                or not slot_timeout_s > 0:
            raise InvalidOptionError(f"slot_timeout_s must be a number > 0, got {slot_timeout_s!r}")
        if optimizer is None:
            optimizers: list[torch.optim.Optimizer] = []
        elif isinstance(optimizer, torch.optim.Optimizer):
            optimizers = [optimizer]
        else:
            try:
                optimizers = list(optimizer)
            except TypeError:
                raise InvalidOptionError(f"optimizer must be a torch.optim.Optimizer (or several), "
                                         f"got {type(optimizer).__name__}") from None
            if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
                raise InvalidOptionError("optimizer must be a torch.optim.Optimizer (or a non-empty sequence "
                                         f"of them), got {optimizers!r}")
        if pin is None:
            pin = any(p.device.type == "cuda" for o in optimizers for g in o.param_groups for p in g["params"])
        self._optimizers = optimizers
        self._pool = HostPool(slots, pin=bool(pin))
        self._engine = CopyEngine("thread")
        self._resolver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asymcheck-dcp-stager")
        self._slot_timeout_s = float(slot_timeout_s)
        self._pending: _Pending | None = None
        self._closed = False
        self._stages = self._failed = self._bytes = self._background = self._inline = 0
        self._stage_s = self._step_wait_s = self._slot_wait_s = 0.0
        self._handles = [o.register_step_pre_hook(lambda opt, args, kwargs: self._before_step())
                         for o in optimizers]

    # -- the AsyncStager protocol --------------------------------------------------------------

    def stage(self, state_dict: StateDict) -> Future[StateDict] | StateDict:
        """Copy ``state_dict`` into a host slot; return the staged state dict, or (with an optimizer) its future.

        The staged state dict has the structure of ``state_dict``: each tensor a CPU view of the slot
        holding the tensor's bytes at this call, every other value a deep copy.

        Raises:
            StagingError: the stager is closed, or no slot came free within ``slot_timeout_s``.
            UnsupportedModelError: a tensor that cannot be staged (a ShardedTensor, a sparse or meta
                tensor...); nothing was copied. A DTensor is staged as its local shard.
        """
        if self._closed:
            raise StagingError("the Stager is closed")
        started = time.perf_counter()
        try:
            self._finish_pending()  # one stage at a time: a save begun before the next step waits for the last
            result = self._stage(state_dict)
        finally:
            self._stage_s += time.perf_counter() - started
        return result

    def synchronize_staging(self) -> None:
        """Wait until the newest stage's copy is done (or failed); its failure goes to its save, not here."""
        self._finish_pending()

    def close(self) -> None:
        """Wait for the copy in progress, remove the step hooks and stop the threads; idempotent.

        The slots stay allocated while DCP still holds staged views of them (an upload in progress).
        """
        if self._closed:
            return
        self._finish_pending()
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._resolver.shutdown(wait=True)
        self._engine.close()

    def __enter__(self) -> Stager:
        """Return the stager."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close the stager."""
        self.close()

    def stats(self) -> StagerStats:
        """Copies, bytes, host memory and time on the training thread so far."""
        return StagerStats(self._stages, self._failed, self._bytes, self._background, self._inline,
                           self._pool.allocated_bytes, self._stage_s, self._step_wait_s, self._slot_wait_s)

    # -- staging ---------------------------------------------------------------------------------

    def _stage(self, state_dict: StateDict) -> Future[StateDict] | StateDict:
        leaves: list[_Leaf] = []
        seen: dict[tuple[Any, ...], int] = {}
        params, states = _owned_storages(self._optimizers)
        skeleton = self._flatten(state_dict, "", leaves, seen, params, states)
        slot = self._acquire()
        lease = _Lease(self._pool, slot)
        try:
            slot.arrange([leaf.src for leaf in leaves])
            views = _Views(slot, lease)
            staged_views = [views.of(i, leaf.src) for i, leaf in enumerate(leaves)]
            lazy = [i for i, leaf in enumerate(leaves) if leaf.lazy and leaf.src.numel() > 0]
            inline = [i for i, leaf in enumerate(leaves) if not leaf.lazy and leaf.src.numel() > 0]
            pending = self._start(slot, leaves, lazy) if lazy else None
            try:
                for i in inline:  # buffers, RNG states...: what the next forward may change, copied now
                    staged_views[i].copy_(leaves[i].src)
            except BaseException:
                if pending is not None:  # nobody resolves it: let its copies end before the slot comes back
                    self._engine.wait()
                    self._engine.take_bad()
                raise
            nbytes = sum(leaf.src.numel() * leaf.src.element_size() for leaf in leaves)
            self._stages += 1
            self._bytes = nbytes
            self._inline += sum(leaves[i].src.numel() * leaves[i].src.element_size() for i in inline)
            staged: StateDict = _rebuild(skeleton, [_wrap(leaf, view) for leaf, view in zip(leaves, staged_views,
                                                                                            strict=True)])
        finally:
            lease.drop()  # the slot comes back once every staged view is gone
        if pending is None:
            if not self._optimizers:
                return staged
            done: Future[StateDict] = Future()
            done.set_result(staged)
            return done
        self._background += sum(leaves[i].src.numel() * leaves[i].src.element_size() for i in lazy)
        pending.future = self._resolver.submit(self._resolve, pending, staged)
        self._pending = pending
        return pending.future

    def _flatten(self, value: Any, path: str, leaves: list[_Leaf], seen: dict[tuple[Any, ...], int],
                 params: set[tuple[str, int]], states: set[tuple[str, int]]) -> Any:
        """The structure of ``value`` with each tensor replaced by its leaf index (``_Index``)."""
        if isinstance(value, torch.Tensor):
            dtensor = value if is_dtensor(value) else None  # its local tensor is this rank's memory
            src = _check_tensor(path or "<root>", local_of(value) if dtensor is not None else value)
            key = _storage_key(src)
            same = (key, src.storage_offset(), tuple(src.shape), src.stride(), src.dtype, src.is_conj(), src.is_neg())
            if same in seen:  # the same memory twice (tied weights: two detached views): one copy, one view
                return _Index(seen[same])
            param = key in params
            lazy = (param or key in states) and not src.is_conj() and not src.is_neg()
            seen[same] = len(leaves)
            leaves.append(_Leaf(path, src, lazy, param, value if dtensor is not None else src, dtensor))
            return _Index(len(leaves) - 1)
        if isinstance(value, Mapping):
            return {k: self._flatten(v, f"{path}/{k}", leaves, seen, params, states) for k, v in value.items()}
        if isinstance(value, list):
            return [self._flatten(v, f"{path}/{i}", leaves, seen, params, states) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._flatten(v, f"{path}/{i}", leaves, seen, params, states) for i, v in enumerate(value))
        try:
            return _Value(copy.deepcopy(value))  # a value DCP's planner serializes later: taken now
        except Exception as exc:
            raise StagingError(f"{path or '<root>'}: a {type(value).__name__} could not be copied: {exc}") from exc

    def _acquire(self) -> HostSlot:
        """A free slot, waiting (back-pressure) while DCP still writes the stages that hold them all."""
        started = time.perf_counter()
        deadline = started + self._slot_timeout_s
        try:
            while True:
                slot = self._pool.acquire(timeout=min(0.5, max(0.0, deadline - time.perf_counter())))
                if slot is not None:
                    return slot
                gc.collect()  # staged views kept alive only by reference cycles (a failed save's traceback)
                slot = self._pool.acquire(timeout=0)
                if slot is not None:
                    return slot
                if time.perf_counter() >= deadline:
                    raise StagingError(f"no host slot came free within {self._slot_timeout_s:g} s: the saves of "
                                       "earlier stages still hold them (wait for a save's upload before the next "
                                       "save, or give the Stager more slots)")
        finally:
            self._slot_wait_s += time.perf_counter() - started

    def _start(self, slot: HostSlot, leaves: list[_Leaf], lazy: list[int]) -> _Pending:
        """Record what each background source is now, and hand its copy to the engine."""
        versions = [leaves[i].counter._version for i in lazy]
        sampled = [i for i in lazy if leaves[i].param and leaves[i].src.is_contiguous()]
        sample = None
        ready = None
        if sampled:
            parts = [sample_view(leaves[i].src.reshape(-1).view(torch.uint8)) for i in sampled]
            sample = torch.cat([p if p.device.type == "cpu" else p.to("cpu", non_blocking=True) for p in parts])
            if any(p.device.type != "cpu" for p in parts):  # queued on the compute stream, after the step
                ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ready.record()
        jobs = []
        for at, i in enumerate(lazy):
            src = leaves[i].src
            nbytes = src.numel() * src.element_size()
            jobs.append(CopyJob(src, slot.region(i), 0, nbytes, versions[at], src.data_ptr(), storage_need(src), i,
                                leaves[i].counter))
        self._engine.submit(jobs)
        return _Pending(Future(), lazy, leaves, versions, sampled, sample, ready, slot)

    def _resolve(self, pending: _Pending, staged: StateDict) -> StateDict:
        """On the stager's thread: wait for the copies, check them, and give DCP the staged state dict."""
        try:
            event = self._engine.wait()
            if event is not None:
                event.synchronize()
            if pending.sample_ready is not None:
                pending.sample_ready.synchronize()
            bad = set(self._engine.take_bad())
            for at, i in enumerate(pending.lazy):  # changed after its copy began: its bytes may be torn
                if pending.leaves[i].counter._version != pending.versions[at]:
                    bad.add(i)
            if pending.sample is not None and not bad.issuperset(pending.sampled):
                slot = pending.slot
                copied = torch.cat([sample_view(slot.region(i)) for i in pending.sampled])
                if not torch.equal(copied, pending.sample):  # an edit through .data: find which
                    at = 0
                    for i in pending.sampled:
                        n = sample_view(slot.region(i)).numel()
                        if not torch.equal(sample_view(slot.region(i)), pending.sample[at:at + n]):
                            bad.add(i)
                        at += n
            if bad:
                names = ", ".join(pending.leaves[i].path for i in sorted(bad)[:5])
                raise StagingError(f"{len(bad)} tensor(s) changed before their staging copy finished ({names}"
                                   f"{', ...' if len(bad) > 5 else ''}): this save writes nothing. Change "
                                   "them only after the optimizer's next step (or wait for staging_completion)")
        except BaseException:
            self._failed += 1
            raise
        return staged

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not pending.future.done():
            started = time.perf_counter()
            wait_futures([pending.future])
            logger.debug("waited %.4f s for a staging copy", time.perf_counter() - started)

    def _before_step(self) -> None:
        """The optimizer's step pre-hook: the step must not change what the copy still reads."""
        started = time.perf_counter()
        self._finish_pending()
        self._step_wait_s += time.perf_counter() - started


class _Views:
    """Fresh typed views of one slot's regions for one stage, all made from one base tensor per dtype.

    Each base is a tensor of its own over the slot's memory (not a view), so every view of it (and
    every view DCP makes of those) keeps it alive: the lease holds the bases, not each view, and the
    slot comes back once the last view of this stage is gone. The slot's own cached views are never
    handed out.
    """

    def __init__(self, slot: HostSlot, lease: _Lease) -> None:
        self.slot, self.lease = slot, lease
        self._storage = slot.buffer.untyped_storage()
        self._start = slot.buffer.storage_offset()  # bytes: the buffer is a uint8 view of the allocation
        self._bases: dict[torch.dtype, torch.Tensor] = {}

    def of(self, i: int, src: torch.Tensor) -> torch.Tensor:
        """Region ``i`` as a contiguous tensor of ``src``'s dtype and shape, marked lent (the writer adopts it)."""
        if src.numel() == 0:
            return torch.empty(src.shape, dtype=src.dtype)
        size = src.element_size()
        at = self._start + self.slot.offsets[i]
        if at % size:  # never with the slots' alignment; a plain view then, held by itself
            view = self.slot.region(i).view(src.dtype).view(src.shape)
            self.lease.hold(view)
        else:
            base = self._bases.get(src.dtype)
            if base is None:
                base = torch.empty(0, dtype=src.dtype)
                base.set_(self._storage, 0, (self._storage.nbytes() // size,), (1,))
                self._bases[src.dtype] = base
                self.lease.hold(base)
            view = base.as_strided(src.shape, _contiguous_strides(src.shape), at // size)
        lend(view)  # our StorageWriter adopts it (no private copy): the slot stays ours until the store let go
        return view


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(1, n)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class _Index:
    """A tensor's place in the staged state dict: leaf number ``i``."""

    i: int


@dataclass(frozen=True)
class _Value:
    """A non-tensor value, copied."""

    value: Any


def _wrap(leaf: _Leaf, view: torch.Tensor) -> torch.Tensor:
    """The staged value of ``leaf``: its view, or for a DTensor a DTensor of the same mesh and placements over it."""
    dt = leaf.dtensor
    if dt is None:
        return view
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(view, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape,
                              stride=dt.stride())


def _rebuild(skeleton: Any, views: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Index):
        return views[skeleton.i]
    if isinstance(skeleton, _Value):
        return skeleton.value
    if isinstance(skeleton, dict):
        return {k: _rebuild(v, views) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_rebuild(v, views) for v in skeleton]
    assert isinstance(skeleton, tuple)
    return tuple(_rebuild(v, views) for v in skeleton)
