"""Staging of one step: private host copies of put tensors, cut into checksummed chunks.

Many small tensors given in one ``put_many`` / ``adopt_many`` call (at least
:data:`PACK_MIN_TENSORS` of them) are staged in bulk instead: copied back to
back into *packs*, one private buffer of at most :data:`PACK_BYTES` each,
hashed once per pack while the bytes are hot. A pack is one chunk of the
version (format 3 manifests, :mod:`asymstore.format.manifest`), so 10,000
tensors of 4 KiB are three chunks to write, describe and verify, not 10,000.
Each tensor starts at an offset aligned to its item size; the bytes between
are zero. ``put_many`` copies them at once (the caller may change its
tensors when it returns); ``adopt_many`` too (their bytes would be gathered
into one buffer for the segment writer anyway).

Packing the chunks into segments is per tier (:mod:`asymstore.write.segments`).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import mmap
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from asymstore.errors import DuplicateNameError, InvalidNameError, InvalidValueError, StepCommittedError
from asymstore.format.checksum import checksum
from asymstore.format.manifest import DTYPE_SIZES, validate_name, validate_names
from asymstore.format.tensors import as_bytes, chunk_views, dtype_name, host_copy
from asymstore.runtime.gcpause import gc_paused
from asymstore.values import KnownChunks

logger = logging.getLogger(__name__)

_INLINE_BYTES = 1 << 20  # below this a put copies on the event loop; above, in a thread

PACK_BYTES = 16 << 20
"""Raw bytes of one pack at most (and never more than the store's ``chunk_bytes``)."""
PACK_TENSOR_BYTES = 64 << 10
"""Largest tensor staged into a pack; larger ones are chunks of their own."""
PACK_MIN_TENSORS = 32
"""A ``put_many`` / ``adopt_many`` of fewer tensors stages each one on its own (its manifest stays format 2)."""

Kind = tuple[str, int, int]
"""A storable dtype's manifest name, item size and byte-plane width."""
_KINDS: dict[torch.dtype, Kind] = {}
for _name, _size in DTYPE_SIZES.items():
    _dtype = getattr(torch, _name, None)
    if isinstance(_dtype, torch.dtype) and _dtype.itemsize == _size and dtype_name(_dtype) == _name:
        _KINDS[_dtype] = (_name, _size, _size // 2 if _dtype.is_complex else _size)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
# memmove without a result object to build (ctypes.memmove returns a c_void_p): the per-tensor copy of a pack
_copy = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value or 0)


@dataclass(eq=False)
class StagedPack:
    """Small tensors copied back to back into one private buffer: one chunk, one checksum.

    ``PendingStep.tensors`` maps each member's name to its pack.
    """

    view: memoryview  # the pack's raw bytes
    checksum: str
    width: int  # byte-plane width of the members (1 when they differ)
    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]  # of each member in ``view``, aligned to its item size
    sizes: list[int]  # bytes of each member
    adopted: bool = False  # staged by ``adopt_many`` (a private copy all the same)

    @property
    def nbytes(self) -> int:
        """Raw bytes of the member tensors (padding not counted)."""
        return sum(self.sizes)


def packable(values: Sequence[object], limit: int) -> tuple[list[torch.Tensor], list[Kind], list[int]]:
    """The leading run of ``values`` that can be staged into packs: the tensors, their kinds and bytes.

    Packable: a plain dense tensor (or ``Parameter``) of a storable dtype with
    data, of at most ``limit`` bytes. The run ends before the first value that
    is not (a larger tensor, a subclass, a meta tensor, an unsupported dtype,
    not a tensor at all): the per-tensor path copies it or raises its typed error.
    """
    tensors: list[torch.Tensor] = []
    kinds: list[Kind] = []
    sizes: list[int] = []
    plain, known, strided = _PLAIN, _KINDS, _STRIDED
    for value in values:
        if type(value) not in plain:
            break
        assert isinstance(value, torch.Tensor)
        kind = known.get(value.dtype)
        if kind is None or value.layout is not strided or value.is_meta:
            break
        nbytes: int = value.nbytes
        if nbytes > limit:
            break
        tensors.append(value)
        kinds.append(kind)
        sizes.append(nbytes)
    return tensors, kinds, sizes


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def pack_memory(size: int) -> tuple[memoryview, int]:
    """A fresh writable buffer of ``size`` bytes for a pack, and its address.

    Anonymous private memory whose pages the one ``mmap`` call faults in
    (``MAP_POPULATE``): a page fault per 4 KiB as the copies land costs more
    than the copies themselves. Unmapped when the last view of it goes.
    Elsewhere (no ``MAP_POPULATE``), memory from torch.
    """
    if size <= 0:
        return memoryview(bytearray()), 0
    if _POPULATE:
        try:
            view = memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE))
        except OSError:  # no memory for it now: torch's allocator says so its own way
            pass
        else:
            return view, ctypes.addressof(ctypes.c_char.from_buffer(view))
    buf = torch.empty(size, dtype=torch.uint8)
    return as_bytes(buf), buf.data_ptr()


_ARENA_ALIGN = 64  # where each pack carved from a :class:`PackArena` starts (a cache line)


class PackArena:
    """One allocation that the packs of one ``put_many`` / ``adopt_many`` call are carved from.

    The small tensors of a call form one pack per run between its larger
    tensors (a model's biases and norms between its weights: tens of runs per
    version). Each pack taking a fresh mapping cost a ``mmap``, its page
    faults and a ``munmap`` per run and version; carved from one arena sized
    for the whole call, they cost one. A pack gives back the tail it did not
    fill (:meth:`trim`); one that does not fit what is left (a run longer than
    one pack holds makes more packs than runs) gets memory of its own
    (:func:`pack_memory`).
    The packs are disjoint slices of the arena, each starting on 64 bytes; the
    mapping is unmapped when the last pack's view goes, as a pack's own would.
    """

    def __init__(self, size: int) -> None:
        """Allocate ``size`` bytes (none when ``size`` is 0)."""
        self.view, self.base = pack_memory(size)
        self.used = 0
        self.last: int | None = None  # where the pack taken last starts (until trimmed)
        self.fresh = 0
        """Packs that did not fit and took memory of their own."""

    def take(self, size: int) -> tuple[memoryview, int]:
        """``size`` bytes for one pack, and their address (from the arena when they fit)."""
        at = self.used + (-self.used % _ARENA_ALIGN)
        if size <= 0 or at + size > len(self.view):
            self.fresh += size > 0
            return pack_memory(size)
        self.used = at + size
        self.last = at
        return self.view[at:at + size], self.base + at

    def trim(self, base: int, used: int) -> None:
        """Give back what the pack taken last at address ``base`` did not fill beyond ``used`` bytes."""
        if self.last is not None and base == self.base + self.last:
            self.used = self.last + used
            self.last = None


def arena_bytes(values: Sequence[object], limit: int) -> int:
    """An upper bound on the arena the packable values of one call need (see :class:`PackArena`).

    What :func:`pack_tensors` asks for each run of packable values (their bytes
    and the most padding they can need), plus the alignment of each run's pack.
    """
    total = 0
    run = False
    plain, known, strided = _PLAIN, _KINDS, _STRIDED
    for value in values:
        ok = False
        if type(value) in plain:
            assert isinstance(value, torch.Tensor)
            kind = known.get(value.dtype)
            nbytes: int = value.nbytes
            ok = kind is not None and value.layout is strided and not value.is_meta and nbytes <= limit
            if ok:
                assert kind is not None
                total += nbytes + kind[1] - 1 + (0 if run else _ARENA_ALIGN)
        run = ok
    return total


def pack_tensors(names: Sequence[str], tensors: Sequence[torch.Tensor], kinds: Sequence[Kind],
                 sizes: Sequence[int], capacity: int, *, adopted: bool = False,
                 arena: PackArena | None = None) -> list[StagedPack]:
    """Copy ``tensors`` (each at most ``capacity`` bytes) into packs of at most ``capacity`` bytes, in order.

    One copy per tensor straight into the pack (a ``memmove`` for contiguous
    CPU tensors, GIL released), then one checksum per pack while it is hot.
    ``adopted``: the tensors passed :func:`check_adoptable` (``adopt_many``).
    ``arena``: where the packs' memory is carved from (default: a fresh mapping per pack).
    """
    packs: list[StagedPack] = []
    left = sum(sizes) + sum(kind[1] - 1 for kind in kinds)  # bytes still to place, with the most padding needed
    total = len(tensors)
    copy, memset = _copy, ctypes.memset
    i = 0
    while i < total:
        size = min(capacity, left)
        buf, base = pack_memory(size) if arena is None else arena.take(size)
        first = i
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        offsets: list[int] = []
        widths: set[int] = set()
        used = 0
        while i < total:
            dname, itemsize, width = kinds[i]
            n = sizes[i]
            at = used + (-used % itemsize)
            if at + n > size:
                break
            t = tensors[i]
            if at > used:
                memset(base + used, 0, at - used)
            if n:
                if adopted or (t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()):
                    copy(base + at, t.data_ptr(), n)  # adopted: checked contiguous CPU memory already
                else:
                    src = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
                    copy(base + at, src.data_ptr(), n)
            dtypes.append(dname)
            shapes.append(tuple(t.shape))
            offsets.append(at)
            widths.add(width)
            used = at + n
            left -= n + itemsize - 1
            i += 1
        if arena is not None:
            arena.trim(base, used)
        view = buf[:used]
        packs.append(StagedPack(view, checksum(view), widths.pop() if len(widths) == 1 else 1, list(names[first:i]),
                                dtypes, shapes, offsets, list(sizes[first:i]), adopted))
    return packs


def stages_inline(value: object) -> bool:
    """True when ``PendingStep.put(name, value)`` stages on the calling thread, without suspending."""
    return not isinstance(value, torch.Tensor) or value.numel() * value.element_size() <= _INLINE_BYTES


@dataclass
class StagedTensor:
    """A private CPU copy of one tensor, cut into checksummed chunks."""

    tensor: torch.Tensor
    chunks: list[tuple[memoryview, str]]  # (bytes, checksum) in byte order
    adopted: bool = False  # the caller's memory (``AsymStore.adopt``), not a private copy

    @property
    def nbytes(self) -> int:
        """Raw bytes of the tensor."""
        return sum(len(view) for view, _ in self.chunks)


def stage(value: object, chunk_bytes: int) -> StagedTensor:
    """Copy ``value`` to private host memory and checksum it chunk by chunk.

    Chunks are cut at element boundaries (``chunk_bytes`` rounded down to a
    multiple of the element size), so every chunk splits into whole byte planes.
    """
    return _cut(host_copy(value), chunk_bytes, adopted=False)


def check_adoptable(value: object) -> torch.Tensor:
    """Return ``value`` if the store can take it over without a copy (a dense, contiguous CPU tensor).

    Raises:
        InvalidValueError: anything else (``put`` copies those).
    """
    if not isinstance(value, torch.Tensor):
        raise InvalidValueError(f"expected a torch.Tensor, got {type(value).__name__}")
    if value.layout is not _STRIDED or value.is_quantized or value.dtype not in _KINDS:
        raise InvalidValueError(f"a {value.layout} tensor of {value.dtype} cannot be stored")
    if not value.is_cpu or not value.is_contiguous() or value.is_conj() or value.is_neg():
        raise InvalidValueError("adopt takes contiguous CPU tensors only (put copies any other tensor)")
    if type(value) is not torch.Tensor:  # a subclass may not own the memory it reports
        raise InvalidValueError(f"adopt takes plain tensors, got {type(value).__name__}")
    return value


def adopt(value: torch.Tensor, chunk_bytes: int) -> StagedTensor:
    """Checksum ``value`` chunk by chunk in place: the staged chunks are views of the caller's memory."""
    return _cut(value.detach(), chunk_bytes, adopted=True)


def adopt_known(value: KnownChunks, chunk_bytes: int) -> StagedTensor:
    """Stage ``value.tensor`` itself with the checksums the caller gave (nothing is hashed).

    Raises:
        InvalidValueError: not an adoptable tensor, checksums taken with another chunk size, or
            not one well-formed checksum per chunk.
    """
    tensor = check_adoptable(value.tensor).detach()
    if value.chunk_bytes != chunk_bytes:
        raise InvalidValueError(f"checksums taken with chunks of {value.chunk_bytes} bytes; the store cuts "
                                f"{chunk_bytes}")
    views = chunk_views(tensor, chunk_bytes)
    sums = value.checksums
    if len(sums) != len(views) or not all(isinstance(c, str) and len(c) == 16 for c in sums):
        raise InvalidValueError(f"{len(views)} chunk checksum(s) needed (16 hex digits each), got {len(sums)}")
    return StagedTensor(tensor, list(zip(views, sums, strict=True)), adopted=True)


def _cut(tensor: torch.Tensor, chunk_bytes: int, *, adopted: bool) -> StagedTensor:
    return StagedTensor(tensor, [(view, checksum(view)) for view in chunk_views(tensor, chunk_bytes)], adopted)


@dataclass
class PendingStep:
    """Everything put for one step that is not committed yet."""

    step: int
    chunk_bytes: int
    tensors: dict[str, StagedTensor | StagedPack | None] = field(default_factory=dict)
    inflight: set[asyncio.Task[None]] = field(default_factory=set)
    sealed: bool = False
    releases: list[Callable[[], None]] = field(default_factory=list)  # owners of adopted tensors
    run: Callable[[Callable[[], StagedTensor]], Awaitable[StagedTensor]] | None = None
    """Runs a large tensor's copy and checksums in a thread (the store's pipeline pool); None: ``asyncio.to_thread``."""

    def release_all(self) -> None:
        """Hand every adopted tensor back to its owner (each callback once; errors are logged)."""
        releases, self.releases = self.releases, []
        for release in releases:
            try:
                release()
            except Exception:
                logger.exception("a release callback of step %d failed", self.step)

    def put_known(self, name: str, value: KnownChunks) -> None:
        """Stage ``value`` under ``name`` without copying or hashing it (:func:`adopt_known`)."""
        validate_name(name)
        if self.sealed:
            raise StepCommittedError(f"step {self.step} is being committed; put is closed")
        if name in self.tensors:
            raise DuplicateNameError(f"{name!r} was already put for step {self.step}")
        self.tensors[name] = adopt_known(value, self.chunk_bytes)

    async def put(self, name: str, value: object, *, adopted: bool = False) -> None:
        """Stage ``value`` under ``name`` (a copy, or the tensor itself when ``adopted``).

        The name is reserved before any await.
        """
        validate_name(name)
        if self.sealed:
            raise StepCommittedError(f"step {self.step} is being committed; put is closed")
        if name in self.tensors:
            raise DuplicateNameError(f"{name!r} was already put for step {self.step}")
        self.tensors[name] = None  # reserve the name
        try:
            fn = adopt if adopted else stage
            if stages_inline(value):
                staged = fn(value, self.chunk_bytes)  # type: ignore[arg-type]
            elif self.run is not None:
                staged = await self.run(functools.partial(fn, value, self.chunk_bytes))  # type: ignore[arg-type]
            else:
                staged = await asyncio.to_thread(fn, value, self.chunk_bytes)  # type: ignore[arg-type]
        except BaseException:
            del self.tensors[name]
            raise
        self.tensors[name] = staged

    def put_packed(self, items: Sequence[tuple[str, object]], limit: int, *, adopted: bool = False,
                   arena: PackArena | None = None) -> int:
        """Stage the leading run of packable ``items`` into packs, on the calling thread; return its length.

        ``limit``: the largest tensor packed (see :func:`packable`; packs hold
        at most ``min(PACK_BYTES, chunk_bytes)``). Like that many ``put``
        calls in order: when a name is refused, the tensors before it are
        staged and the error is raised. ``arena``: where the packs' memory is
        carved from (one per call of ``put_many``; default: a mapping per pack).
        """
        if self.sealed:
            raise StepCommittedError(f"step {self.step} is being committed; put is closed")
        tensors, kinds, sizes = packable([value for _, value in items], limit)
        names = [name for name, _ in items[:len(tensors)]]
        refused: InvalidNameError | DuplicateNameError | None = None
        staged = self.tensors
        try:
            validate_names(names)
            if not staged.keys().isdisjoint(names):
                raise DuplicateNameError("")
        except (InvalidNameError, DuplicateNameError):
            for i, name in enumerate(names):  # the first refused name: those before it are staged
                try:
                    validate_name(name)
                    if name in staged:
                        raise DuplicateNameError(f"{name!r} was already put for step {self.step}") from None
                except (InvalidNameError, DuplicateNameError) as exc:
                    refused = exc
                    del names[i:], tensors[i:], kinds[i:], sizes[i:]
                    break
        with gc_paused():  # thousands of fresh objects, no cycles: no collector pass over them all meanwhile
            packs = pack_tensors(names, tensors, kinds, sizes, min(PACK_BYTES, self.chunk_bytes), adopted=adopted,
                                 arena=arena)
        for pack in packs:
            staged.update(dict.fromkeys(pack.names, pack))
        if refused is not None:
            raise refused
        return len(names)

    @property
    def nbytes(self) -> int:
        """Raw bytes staged so far."""
        return sum(t.nbytes for t in {id(t): t for t in self.tensors.values() if t is not None}.values())
