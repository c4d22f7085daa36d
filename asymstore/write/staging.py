"""Staging of one step: private host copies of put tensors, cut into checksummed chunks.

Packing the chunks into segments is per tier (:mod:`asymstore.write.segments`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from asymstore.errors import DuplicateNameError, InvalidValueError, StepCommittedError
from asymstore.format.checksum import checksum
from asymstore.format.manifest import DTYPE_SIZES, validate_name
from asymstore.format.tensors import as_bytes, dtype_name, host_copy

logger = logging.getLogger(__name__)

_INLINE_BYTES = 1 << 20  # below this a put copies on the event loop; above, in a thread


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
    if value.layout != torch.strided or value.is_quantized or dtype_name(value.dtype) not in DTYPE_SIZES:
        raise InvalidValueError(f"a {value.layout} tensor of {value.dtype} cannot be stored")
    if value.device.type != "cpu" or not value.is_contiguous() or value.is_conj() or value.is_neg():
        raise InvalidValueError("adopt takes contiguous CPU tensors only (put copies any other tensor)")
    if type(value) is not torch.Tensor:  # a subclass may not own the memory it reports
        raise InvalidValueError(f"adopt takes plain tensors, got {type(value).__name__}")
    return value


def adopt(value: torch.Tensor, chunk_bytes: int) -> StagedTensor:
    """Checksum ``value`` chunk by chunk in place: the staged chunks are views of the caller's memory."""
    return _cut(value.detach(), chunk_bytes, adopted=True)


def _cut(tensor: torch.Tensor, chunk_bytes: int, *, adopted: bool) -> StagedTensor:
    data = as_bytes(tensor)
    itemsize = tensor.element_size()
    chunk_bytes = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    chunks = [(data[i:i + chunk_bytes], checksum(data[i:i + chunk_bytes]))
              for i in range(0, len(data), chunk_bytes)] or [(data, checksum(data))]
    return StagedTensor(tensor, chunks, adopted)


@dataclass
class PendingStep:
    """Everything put for one step that is not committed yet."""

    step: int
    chunk_bytes: int
    tensors: dict[str, StagedTensor | None] = field(default_factory=dict)
    inflight: set[asyncio.Task[None]] = field(default_factory=set)
    sealed: bool = False
    releases: list[Callable[[], None]] = field(default_factory=list)  # owners of adopted tensors

    def release_all(self) -> None:
        """Hand every adopted tensor back to its owner (each callback once; errors are logged)."""
        releases, self.releases = self.releases, []
        for release in releases:
            try:
                release()
            except Exception:
                logger.exception("a release callback of step %d failed", self.step)

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
            else:
                staged = await asyncio.to_thread(fn, value, self.chunk_bytes)  # type: ignore[arg-type]
        except BaseException:
            del self.tensors[name]
            raise
        self.tensors[name] = staged

    @property
    def nbytes(self) -> int:
        """Raw bytes staged so far."""
        return sum(t.nbytes for t in self.tensors.values() if t is not None)
