"""Staging of one step: private host copies of put tensors, cut into checksummed chunks.

Packing the chunks into segments is per tier (:mod:`asymstore.batcher`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from asymstore.checksum import checksum
from asymstore.errors import DuplicateNameError, StepCommittedError
from asymstore.manifest import validate_name
from asymstore.tensorbytes import as_bytes, host_copy

_INLINE_BYTES = 1 << 20  # below this a put copies on the event loop; above, in a thread


def stages_inline(value: object) -> bool:
    """True when ``PendingStep.put(name, value)`` stages on the calling thread, without suspending."""
    return not isinstance(value, torch.Tensor) or value.numel() * value.element_size() <= _INLINE_BYTES


@dataclass
class StagedTensor:
    """A private CPU copy of one tensor, cut into checksummed chunks."""

    tensor: torch.Tensor
    chunks: list[tuple[memoryview, str]]  # (bytes, checksum) in byte order

    @property
    def nbytes(self) -> int:
        """Raw bytes of the tensor."""
        return sum(len(view) for view, _ in self.chunks)


def stage(value: object, chunk_bytes: int) -> StagedTensor:
    """Copy ``value`` to private host memory and checksum it chunk by chunk.

    Chunks are cut at element boundaries (``chunk_bytes`` rounded down to a
    multiple of the element size), so every chunk splits into whole byte planes.
    """
    tensor = host_copy(value)
    data = as_bytes(tensor)
    itemsize = tensor.element_size()
    chunk_bytes = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    chunks = [(data[i:i + chunk_bytes], checksum(data[i:i + chunk_bytes]))
              for i in range(0, len(data), chunk_bytes)] or [(data, checksum(data))]
    return StagedTensor(tensor, chunks)


@dataclass
class PendingStep:
    """Everything put for one step that is not committed yet."""

    step: int
    chunk_bytes: int
    tensors: dict[str, StagedTensor | None] = field(default_factory=dict)
    inflight: set[asyncio.Task[None]] = field(default_factory=set)
    sealed: bool = False

    async def put(self, name: str, value: object) -> None:
        """Stage ``value`` under ``name``; the name is reserved before any await."""
        validate_name(name)
        if self.sealed:
            raise StepCommittedError(f"step {self.step} is being committed; put is closed")
        if name in self.tensors:
            raise DuplicateNameError(f"{name!r} was already put for step {self.step}")
        self.tensors[name] = None  # reserve the name
        try:
            if stages_inline(value):
                staged = stage(value, self.chunk_bytes)
            else:
                staged = await asyncio.to_thread(stage, value, self.chunk_bytes)
        except BaseException:
            del self.tensors[name]
            raise
        self.tensors[name] = staged

    @property
    def nbytes(self) -> int:
        """Raw bytes staged so far."""
        return sum(t.nbytes for t in self.tensors.values() if t is not None)
