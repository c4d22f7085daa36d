"""Replicated state written once per job: under DDP each rank copies, hashes and writes only its slice.

Under DDP every rank holds the same parameters and optimizer state. With ``dedup="replicas"``
(:class:`asymcheck.options.CommitOptions`) the Checkpointer of a multi-rank store cuts every such
tensor of a version into one ``"S(0)"`` piece per rank (``torch.chunk`` rows, as
:mod:`asymstore.format.pieces` records them) and each rank copies (device to host), hashes and writes
only its piece: the bytes per rank shrink to about ``1 / world``. Which rank holds a tensor's largest
piece is chosen by balanced bin-packing (largest tensors first, onto the least loaded rank), so small
tensors whose rows are fewer than the ranks do not all land on rank 0.

Identity is verified, never assumed: before slicing, each rank digests the replicated state (names,
shapes, dtypes and bytes: every byte in the first :data:`FULL_VERSIONS` versions of the job, a sample
of :data:`SAMPLES` elements per tensor, at positions that move with the step, afterwards) and puts
the digest into the shard's claim (:mod:`asymstore.format.replicas`). The store's coordinator
publishes a sliced version only when every rank's digest is the same; otherwise the version is
never published (its restore would mix ranks' states), every rank writes whole copies for the rest
of the job, and a WARNING says so.

What is sliced: the lazily copied tensors (parameters, optimizer state) of a model wrapped in
``DistributedDataParallel`` (or one its caller declares replicated, :data:`Replication`: the framework
integrations, which train the module under DDP and hand the Checkpointer the module inside the
wrapper) trained by an optimizer that is not ``ZeroRedundancyOptimizer``, on a
store of several ranks whose slices a restore gets at (:class:`asymstore.protocols.ReplicaSlicingStore`:
a directory's default tiers under a shared root, or tiers of each rank's own, whose slices the ranks exchange
at resume). DTensors (FSDP2) keep their own layouts and nothing is sliced beside them; buffers, RNG states and
0-d tensors stay whole. A restore reads the slices every rank needs where they live
(:mod:`asymstore.multirank.reshard`), or the ranks exchange them (:mod:`asymcheck.restore.exchange`).

An adapter's training state of which only a part is replicated (DeepSpeed ZeRO-0/1/2: the module
parameters, while each rank's optimizer partition is its own) says which of its sources are:
:class:`ReplicatedState`, through :func:`slicer_for`. Only those are sliced and digested.
Guide: docs/guides/multirank.md ("Replicated state").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import torch

from asymcheck.state.capture import Capture
from asymstore.format.checksum import StreamingChecksum
from asymstore.format.pieces import MeshInfo, TensorLayout
from asymstore.format.replicas import REPLICAS_KEY, ReplicaClaim
from asymstore.format.tensors import dtype_name
from asymstore.protocols import ReplicaSlicingStore

logger = logging.getLogger(__name__)

__all__ = ["DEDUPS", "FULL_VERSIONS", "REPLICATIONS", "SAMPLES", "Dedup", "Digest", "ReplicaSlicer", "ReplicatedState",
           "Replication", "gather_digest", "replica_digest", "slice_plan", "slicer_for"]

Dedup = Literal["replicas", "off"]
"""``"replicas"``: each rank writes its slice of the replicated state; ``"off"``: every rank writes all of it."""
DEDUPS: tuple[str, ...] = get_args(Dedup)

Replication = Literal["detect", "replicated"]
"""How the Checkpointer knows its model's state is the same on every rank: ``"detect"``: the model is a
``DistributedDataParallel``; ``"replicated"``: its caller says so (a framework integration under DDP, whose
framework holds the wrapper and hands over the module inside it). Either way the replicas are compared
across ranks before a sliced version is published, and a job whose replicas differ writes whole copies."""
REPLICATIONS: tuple[str, ...] = get_args(Replication)

FULL_VERSIONS = 2
"""The first versions of a job whose replicas are compared byte for byte (every byte digested)."""
SAMPLES = 64
"""Elements per tensor digested in every later version."""
MAX_ROTATIONS = 64
"""At most this many distinct assignments of pieces to ranks (each a mesh listed in the version's layout)."""

Slice = tuple[int, TensorLayout]
"""A source's index in the capture and its piece."""


def slice_plan(sources: Sequence[torch.Tensor], rank: int, world: int) -> list[Slice]:
    """This rank's ``"S(0)"`` piece of every sliceable source, the pieces balanced over the ranks.

    Sources are taken largest first; each one's largest piece (coordinate 0) goes to the least
    loaded rank, the next pieces to the ranks after it. The same on every rank for the same shapes.
    0-d, empty and non-contiguous tensors are not sliced.
    """
    loads = [0] * world
    out: list[Slice] = []
    order = sorted(range(len(sources)), key=lambda i: (-sources[i].numel() * sources[i].element_size(), i))
    for i in order:
        t = sources[i]
        if t.dim() == 0 or t.shape[0] == 0 or not t.is_contiguous():
            continue
        rows = int(t.shape[0])
        row_bytes = t.numel() // rows * t.element_size()
        rot = min(range(min(world, MAX_ROTATIONS)), key=lambda r: (loads[r], r))
        full = -(-rows // world)
        for c in range(world):
            loads[(rot + c) % world] += max(0, min(rows, full * (c + 1)) - min(rows, full * c)) * row_bytes
        mesh = MeshInfo((world,), tuple((rot + c) % world for c in range(world)), ((rank - rot) % world,))
        out.append((i, TensorLayout.sharded(t.shape, dtype_name(t.dtype), mesh, ("S(0)",))))
    out.sort(key=lambda s: s[0])
    return out


class Digest:
    """A digest of a replicated state taken at one moment, hashed later (:meth:`hexdigest`).

    The bytes are gathered when the step returns: on the host at once, or on a CUDA device into
    pinned memory behind an event (no synchronisation on the training thread); they are hashed when
    the version is sealed, once its copies are waited for anyway.
    """

    def __init__(self, header: bytes, parts: list[torch.Tensor], event: object = None) -> None:
        """Keep the gathered bytes (host tensors, or pinned ones the ``event`` completes)."""
        self._header = header
        self._parts = parts
        self._event = event

    def hexdigest(self) -> str:
        """Wait for the gathered bytes if needed, then hash the header and every part."""
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]
            self._event = None
        h = StreamingChecksum()
        h.update(self._header)
        for part in self._parts:
            if part.numel():
                h.update(memoryview(part.view(torch.uint8).numpy()).cast("B"))  # type: ignore[arg-type]
        return h.hexdigest()


def gather_digest(names: Sequence[str], sources: Sequence[torch.Tensor], step: int, *, full: bool) -> Digest:
    """Take the bytes the digest of a replicated state covers: every byte (``full``) or a sample.

    The header covers names, shapes and dtypes. The sample takes :data:`SAMPLES` evenly spaced
    elements of each tensor, starting at an offset that moves with ``step`` (over the versions
    every element is looked at): views, then one gather per device and dtype. ``full`` copies every
    tensor to the host now (synchronously: the first versions only).
    """
    header = repr([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in zip(names, sources, strict=True)]).encode()
    if full:
        return Digest(header, [t.detach().reshape(-1).contiguous().cpu() for t in sources if t.numel()])
    picks: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for i, t in enumerate(sources):
        n = t.numel()
        if not n:
            continue
        stride = max(1, n // SAMPLES)
        start = (step * 40503 + i) % stride
        k = min(SAMPLES, (n - start + stride - 1) // stride)
        if t.is_contiguous():  # one view op per tensor
            pick = t.detach().as_strided((k,), (stride,), t.storage_offset() + start)
        else:
            pick = t.detach().reshape(-1)[start:start + stride * k:stride]
        picks.setdefault((str(t.device), t.dtype), []).append(pick)
    parts: list[torch.Tensor] = []
    event = None
    for key in sorted(picks, key=str):
        sample = torch.cat(picks[key])
        if sample.device.type == "cuda":  # queued after the step on the current stream; no wait here
            host = torch.empty(sample.shape, dtype=sample.dtype, pin_memory=True)
            host.copy_(sample, non_blocking=True)
            sample = host
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        elif sample.device.type != "cpu":
            sample = sample.cpu()
        parts.append(sample)
    return Digest(header, parts, event)


def replica_digest(names: Sequence[str], sources: Sequence[torch.Tensor], step: int, *, full: bool) -> str:
    """The digest of a replicated state now (see :func:`gather_digest`)."""
    return gather_digest(names, sources, step, full=full).hexdigest()


def _replicated(model: torch.nn.Module, optimizer: torch.optim.Optimizer, replication: Replication) -> bool:
    """Whether the model's parameters and the optimizer's state are the same on every rank (DDP, no ZeRO)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    declared = replication == "replicated" or isinstance(model, DistributedDataParallel)
    return declared and not isinstance(optimizer, ZeroRedundancyOptimizer)


class ReplicaSlicer:
    """Cuts each version's replicated state into this rank's slice (see the module docstring).

    Args:
        store: the opened store (slicing needs a :class:`asymstore.protocols.ReplicaSlicingStore` of
            several ranks).
        model: the module trained (slicing needs ``DistributedDataParallel``, or ``replication="replicated"``).
        optimizer: its optimizer (not ``ZeroRedundancyOptimizer``).
        dedup: ``"replicas"`` or ``"off"`` (never slice).
        replication: how the model is known to be replicated (:data:`Replication`).
        select: which of a capture's sources (by name) are replicated; None: every one (DDP).
    """

    def __init__(self, store: object, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 dedup: Dedup, replication: Replication = "detect", *,
                 select: Callable[[str], bool] | None = None) -> None:
        """Decide whether this job slices at all."""
        self._select = select
        self._store = store if isinstance(store, ReplicaSlicingStore) else None
        self.enabled = (dedup == "replicas" and self._store is not None and self._store.world_size > 1
                        and self._store.slices_readable and _replicated(model, optimizer, replication))
        """Whether versions are sliced (until the job falls back to whole copies)."""
        self.rank = self._store.rank if self._store is not None else 0
        self.world = self._store.world_size if self._store is not None else 1
        self.digested = 0
        """Versions digested so far (the first :data:`FULL_VERSIONS` in full)."""
        self.digest_s = 0.0
        """Seconds spent digesting (the training thread's cost of the identity check)."""
        self.fell_back = False
        """The job fell back to whole copies (the replicas of a version differed)."""
        self._key: tuple[object, ...] | None = None
        self._plan: list[Slice] = []
        self._chosen: list[int] = []  # indices of the replicated sources in the capture the plan was made for
        self._pending: dict[int, tuple[Digest, bool]] = {}  # step -> its digest gathered at the step, full

    @property
    def active(self) -> bool:
        """Whether the next version is sliced."""
        if not self.enabled:
            return False
        if self._store is not None and self._store.replicas_whole:
            if not self.fell_back:
                self.fell_back = True
                logger.warning("rank %d: the replicated state differed across ranks in a sliced version (not "
                               "published): writing whole copies of it on every rank for the rest of the job",
                               self.rank)
            return False
        return True

    def apply(self, cap: Capture, step: int) -> None:
        """Replace the replicated sources of ``cap`` (the version of ``step``) by this rank's slices and layouts.

        The digest of the whole replicated state is gathered now; :meth:`finish` puts the claim
        into the version's meta when it is sealed.
        """
        self._pending.pop(step, None)
        if not self.active or cap.layouts:  # DTensors (FSDP2, HSDP) keep their own layouts
            return
        chosen = (list(range(len(cap.sources))) if self._select is None
                  else [i for i, name in enumerate(cap.names) if self._select(name)])
        key: tuple[object, ...] = tuple((tuple(t.shape), t.dtype, t.is_contiguous()) for t in cap.sources)
        if self._select is not None:
            key = (*key, tuple(chosen))
        if key != self._key:
            picked = slice_plan([cap.sources[i] for i in chosen], self.rank, self.world)
            self._key, self._chosen = key, chosen
            self._plan = [(chosen[j], layout) for j, layout in picked]
        if not self._plan:
            return
        started = time.perf_counter()
        full = self.digested < FULL_VERSIONS
        digest = gather_digest([cap.names[i] for i in self._chosen], [cap.sources[i] for i in self._chosen], step,
                               full=full)
        self.digested += 1
        self.digest_s += time.perf_counter() - started
        for old in [s for s in self._pending if s < step]:  # versions dropped or skipped before their seal
            del self._pending[old]
        self._pending[step] = (digest, full)
        for i, layout in self._plan:
            cap.sources[i] = cap.sources[i].narrow(0, layout.offsets[0], layout.shape[0])
            cap.layouts[cap.names[i]] = layout

    def finish(self, step: int, meta: dict[str, Any]) -> None:
        """Put the claim of the sliced version of ``step`` into its ``meta`` (nothing for a version not sliced)."""
        pending = self._pending.pop(step, None)
        if pending is None:
            meta.pop(REPLICAS_KEY, None)
            return
        started = time.perf_counter()
        digest, full = pending
        meta[REPLICAS_KEY] = ReplicaClaim(self.world, digest.hexdigest(), full).to_json()
        self.digest_s += time.perf_counter() - started


@runtime_checkable
class ReplicatedState(Protocol):
    """An adapter's training state of which a part is the same on every data-parallel rank.

    Implemented by :class:`asymcheck.deepspeed.state.DeepSpeedState` (ZeRO stages 0-2: the module
    parameters, and at stage 0 the optimizer's state, are replicated; each rank's ZeRO partition is not).
    """

    def replicated(self, name: str) -> bool:
        """Whether the captured source ``name`` is the same on every data-parallel rank."""
        ...

    def slice_replicas(self, enabled: bool) -> None:
        """Told once, before the first capture, whether this job's versions hold slices of the replicated part."""
        ...


def slicer_for(store: object, state: object, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               dedup: Dedup, replication: Replication, *, adapter: bool) -> ReplicaSlicer | None:
    """The slicer of a Checkpointer's versions, or None (never sliced).

    A plain training state (``adapter`` False) is sliced whole when replicated (DDP); an adapter's
    state only when it is a :class:`ReplicatedState`, and then only the sources it names.
    """
    if not adapter:
        return ReplicaSlicer(store, model, optimizer, dedup, replication)
    if not isinstance(state, ReplicatedState):
        return None
    slicer = ReplicaSlicer(store, model, optimizer, dedup, replication, select=state.replicated)
    state.slice_replicas(slicer.enabled)
    return slicer
