"""Staging of one step: private host copies of put tensors, and their packing into segments."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from asymstore.checksum import StreamingChecksum, checksum
from asymstore.errors import DuplicateNameError, StepCommittedError
from asymstore.manifest import Chunk, Manifest, SegmentEntry, TensorEntry, validate_name
from asymstore.tensorbytes import as_bytes, dtype_name, host_copy

_INLINE_BYTES = 1 << 20  # below this a put copies on the event loop; above, in a thread


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
    """Copy ``value`` to private host memory and checksum it chunk by chunk."""
    tensor = host_copy(value)
    data = as_bytes(tensor)
    chunks = [(data[i:i + chunk_bytes], checksum(data[i:i + chunk_bytes]))
              for i in range(0, len(data), chunk_bytes)] or [(data, checksum(data))]
    return StagedTensor(tensor, chunks)


@dataclass
class Segment:
    """One segment to write: its name, the buffers that form it, and its checksum."""

    name: str
    parts: list[memoryview]
    size: int
    checksum: str


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
            if isinstance(value, torch.Tensor) and value.numel() * value.element_size() > _INLINE_BYTES:
                staged = await asyncio.to_thread(stage, value, self.chunk_bytes)
            else:
                staged = stage(value, self.chunk_bytes)
        except BaseException:
            del self.tensors[name]
            raise
        self.tensors[name] = staged

    @property
    def nbytes(self) -> int:
        """Raw bytes staged so far."""
        return sum(t.nbytes for t in self.tensors.values() if t is not None)

    def pack(self, segment_bytes: int, meta: dict[str, object], created: float) -> tuple[Manifest, list[Segment]]:
        """Lay the staged chunks out in segments of about ``segment_bytes`` and build the manifest."""
        segments: list[Segment] = []
        entries: dict[str, TensorEntry] = {}
        parts: list[memoryview] = []
        size = 0
        referenced = False  # some chunk points into the open segment

        def close_segment() -> None:
            nonlocal parts, size, referenced
            name = f"seg-{len(segments):06d}.bin"
            segments.append(Segment(name, parts, size, StreamingChecksum(parts).hexdigest()))
            parts, size, referenced = [], 0, False

        for tname, staged in self.tensors.items():
            assert staged is not None, "pack() runs after every put finished"
            chunks = []
            for view, digest in staged.chunks:
                if parts and size + len(view) > segment_bytes:
                    close_segment()
                seg_name = f"seg-{len(segments):06d}.bin"
                chunks.append(Chunk(seg_name, size, len(view), len(view), digest, "raw", digest))
                parts.append(view)
                size += len(view)
                referenced = True
            t = staged.tensor
            entries[tname] = TensorEntry(dtype_name(t.dtype), tuple(t.shape), staged.nbytes, tuple(chunks))
        if referenced:
            close_segment()
        manifest = Manifest(
            step=self.step,
            tensors=entries,
            segments=tuple(SegmentEntry(s.name, s.size, s.checksum) for s in segments),
            meta=dict(meta),
            created=created,
        )
        return manifest, segments
