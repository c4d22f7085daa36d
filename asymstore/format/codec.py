"""Lossless byte-plane codec: split elements into byte planes and zstd each plane.

A chunk of ``n`` bytes is split into ``k`` planes (plane ``i`` holds byte ``i`` of every element;
``k`` the element width), so zstd sees the well-compressing sign and exponent bytes together;
planes that do not shrink are stored as they are. The manifest records the codec per chunk
(``"raw"`` or ``"zstd-planes:<k>"``) with ``checksum`` over the stored bytes and ``raw_checksum``
over the raw ones; :func:`decode_chunk` verifies both. Whether a chunk is worth compressing is the
cost model's call (:mod:`asymstore.write.segments`); :func:`sample` measures what it needs.

The stored form and the compression rule: docs/concepts/batching.md.
"""

from __future__ import annotations

import logging
import statistics
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import zstandard

from asymstore.errors import CodecError, CorruptVersionError
from asymstore.format.checksum import Buffer, StreamingChecksum, checksum
from asymstore.format.manifest import Chunk
from asymstore.format.tensors import as_bytes

logger = logging.getLogger(__name__)

RAW = "raw"
PREFIX = "zstd-planes:"
WIDTHS = (1, 2, 4, 8)
SAMPLE_BYTES = 64 << 10
"""Bytes of a chunk compressed to estimate its ratio (the whole chunk when smaller)."""
INCOMPRESSIBLE = 0.97
"""A plane whose sample does not shrink below this fraction is stored raw, not compressed."""

_WORD = struct.Struct("<Q")
# Planes are gathered and scattered in blocks of rows below torch's parallel grain size (32768
# elements): each copy stays on the calling thread, so no intra-op thread pool wakes up (and spins)
# to compete with zstd and with training for the same cores.
_ROWS = 16384


@dataclass(frozen=True)
class PlaneCodec:
    """Settings of the byte-plane zstd codec.

    Args:
        level: zstd level; low levels (1-3) keep up with disks.
        threads: zstd worker threads per plane; -1 uses one per CPU, 0
            compresses on the calling thread.
    """

    level: int = 1
    threads: int = -1

    def compressor(self) -> zstandard.ZstdCompressor:
        """Return this thread's compressor for these settings (zstd contexts are not thread-safe)."""
        cache: dict[tuple[int, int], zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
        if cache is None:
            cache = _local.compressors = {}
        key = (self.level, self.threads)
        comp = cache.get(key)
        if comp is None:
            comp = cache[key] = zstandard.ZstdCompressor(level=self.level, threads=self.threads)
        return comp


_local = threading.local()


def codec_name(width: int) -> str:
    """Return the manifest name of the byte-plane codec for elements of ``width`` bytes."""
    if width not in WIDTHS:
        raise ValueError(f"plane width must be one of {WIDTHS}, got {width}")
    return f"{PREFIX}{width}"


def parse_codec(name: str) -> int | None:
    """Return the plane width of codec ``name``, or None for ``"raw"``.

    Raises:
        CodecError: the codec is unknown.
    """
    if name == RAW:
        return None
    if name.startswith(PREFIX) and name[len(PREFIX):] in {str(w) for w in WIDTHS}:
        return int(name[len(PREFIX):])
    raise CodecError(f"unknown codec {name!r}")


def plane_width(dtype: torch.dtype) -> int:
    """Return the byte-plane width for ``dtype``: the size of one real component."""
    size = dtype.itemsize
    return size // 2 if dtype.is_complex else size


# -- planes ------------------------------------------------------------------


def _writable(view: memoryview) -> memoryview:
    return memoryview(bytearray(view)) if view.readonly else view


def split_planes(view: memoryview, width: int) -> tuple[list[memoryview], memoryview]:
    """Split ``view`` into ``width`` byte planes plus the trailing bytes that form no whole element.

    The planes are new buffers (one copy of the body); the tail is a view of ``view``.
    """
    m = len(view) // width
    body, tail = view[:m * width], view[m * width:]
    if width == 1 or m == 0:
        return ([body] if width == 1 else [memoryview(b"")] * width), tail
    grid = torch.frombuffer(_writable(body), dtype=torch.uint8).view(m, width)
    planes = [torch.empty(m, dtype=torch.uint8) for _ in range(width)]
    for r in range(0, m, _ROWS):
        rows = grid[r:r + _ROWS]
        for i, plane in enumerate(planes):
            plane[r:r + _ROWS].copy_(rows[:, i])
    return [as_bytes(plane) for plane in planes], tail


def _compress(comp: zstandard.ZstdCompressor, plane: memoryview) -> bytes:
    return comp.compress(plane)


@dataclass
class Encoded:
    """The stored form of one chunk, as buffers to write back to back."""

    parts: list[Buffer]
    nbytes: int
    checksum: str
    seconds: float  # time spent splitting and compressing


def encode(view: memoryview, width: int, codec: PlaneCodec, mask: Sequence[bool] | None = None) -> Encoded:
    """Encode ``view`` (elements of ``width`` bytes) in the ``zstd-planes:<width>`` form.

    Args:
        view: the chunk's raw bytes.
        width: the element (plane) width.
        codec: zstd settings.
        mask: which planes to try to compress (default: all); a plane that
            does not shrink is stored raw either way.
    """
    started = time.perf_counter()
    planes, tail = split_planes(view, width)
    comp = codec.compressor()
    words: list[int] = []
    payload: list[Buffer] = []
    for i, plane in enumerate(planes):
        stored: Buffer = plane
        flag = 0
        if (mask is None or mask[i]) and len(plane):
            packed = _compress(comp, plane)
            if len(packed) < len(plane):
                stored, flag = packed, 1
        words.append(len(stored) << 1 | flag)
        payload.append(stored)
    header = b"".join(_WORD.pack(w) for w in words)
    parts: list[Buffer] = [header, *payload]
    if len(tail):
        parts.append(tail)
    digest = StreamingChecksum(parts).hexdigest()
    return Encoded(parts, sum(len(p) for p in parts), digest, time.perf_counter() - started)


def decode(stored: memoryview, width: int, out: memoryview) -> None:
    """Decode a ``zstd-planes:<width>`` chunk into ``out`` (writable, the raw length).

    Raises:
        CodecError: the stored bytes are not a valid encoding of ``len(out)`` bytes.
    """
    n = len(out)
    m, t = divmod(n, width)
    head = width * _WORD.size
    if len(stored) < head + t:
        raise CodecError(f"stored chunk of {len(stored)} bytes is shorter than its header")
    words = [_WORD.unpack_from(stored, i * _WORD.size)[0] for i in range(width)]
    lengths = [w >> 1 for w in words]
    if head + sum(lengths) + t != len(stored):
        raise CodecError("plane lengths in the header do not add up to the stored length")
    grid = torch.frombuffer(out, dtype=torch.uint8)[:m * width].view(m, width) if m and width > 1 else None
    dctx = zstandard.ZstdDecompressor()
    pos = head
    for i, (word, length) in enumerate(zip(words, lengths, strict=True)):
        payload = stored[pos:pos + length]
        pos += length
        if word & 1:
            try:
                plane: Buffer = dctx.decompress(payload, max_output_size=m)
            except zstandard.ZstdError as exc:
                raise CodecError(f"plane {i}: {exc}") from exc
        else:
            plane = payload
        if len(plane) != m:
            raise CodecError(f"plane {i} holds {len(plane)} bytes, expected {m}")
        if grid is None:
            out[:m] = plane
        elif m:
            src = plane if isinstance(plane, memoryview) and not plane.readonly else bytearray(plane)
            column = torch.frombuffer(src, dtype=torch.uint8)
            for r in range(0, m, _ROWS):
                grid[r:r + _ROWS, i].copy_(column[r:r + _ROWS])
    if t:
        out[m * width:] = stored[pos:pos + t]


def decode_chunk(chunk: Chunk, stored: memoryview, out: memoryview | None = None) -> memoryview:
    """Verify and decode one chunk; return its raw bytes.

    Checks the stored bytes against ``chunk.checksum``, decodes them (into
    ``out`` when given, else a new buffer; a raw chunk is returned as is when
    ``out`` is None), then checks the raw bytes against ``chunk.raw_checksum``.

    Raises:
        CorruptVersionError: a checksum does not match, the codec is unknown
            or the stored bytes do not decode (:class:`CodecError`).
    """
    if len(stored) != chunk.length:
        raise CorruptVersionError(f"chunk holds {len(stored)} bytes, manifest says {chunk.length}")
    if checksum(stored) != chunk.checksum:
        raise CorruptVersionError("stored checksum mismatch")
    width = parse_codec(chunk.codec)
    if width is None:
        if chunk.length != chunk.raw_length:
            raise CorruptVersionError(f"raw chunk of {chunk.length} bytes says raw_length {chunk.raw_length}")
        raw = stored
        if out is not None:
            out[:] = stored
            raw = out
    else:
        raw = out if out is not None else memoryview(bytearray(chunk.raw_length))
        if len(raw) != chunk.raw_length:
            raise ValueError(f"out holds {len(raw)} bytes, the chunk {chunk.raw_length}")
        decode(stored, width, raw)
    expected = chunk.raw_checksum or chunk.checksum
    if width is None:  # raw: the stored bytes, verified above, are the raw bytes (a copy needs no re-hash)
        if expected != chunk.checksum:
            raise CorruptVersionError("raw chunk with two different checksums")
    elif checksum(raw) != expected:
        raise CorruptVersionError("raw checksum mismatch after decoding")
    return raw


# -- sampling ----------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """What compressing the start of one chunk showed.

    Attributes:
        width: plane width.
        nbytes: raw bytes sampled.
        stored: bytes the sample became (planes worth it compressed).
        seconds: time to split the sample and compress the planes worth it.
        mask: which planes are worth compressing.
        encoded: the chunk's full stored form when the sample was the whole chunk.
    """

    width: int
    nbytes: int
    stored: int
    seconds: float
    mask: tuple[bool, ...]
    encoded: Encoded | None = None

    @property
    def ratio(self) -> float:
        """Raw bytes per stored byte (1.0 when nothing is worth compressing)."""
        if not any(self.mask) or self.stored <= 0:
            return 1.0
        return self.nbytes / self.stored

    def compress_seconds(self, nbytes: int) -> float:
        """Estimated time to encode ``nbytes`` of this chunk: fixed overhead plus the sample's per-byte rate."""
        overhead = fixed_overhead_seconds()
        per_byte = max(self.seconds - overhead, 0.0) / max(self.nbytes, 1)
        return overhead + per_byte * nbytes


def sample(view: memoryview, width: int, codec: PlaneCodec) -> Sample:
    """Compress the first :data:`SAMPLE_BYTES` of a chunk, plane by plane, and time it."""
    whole = len(view) <= SAMPLE_BYTES
    size = len(view) if whole else SAMPLE_BYTES - SAMPLE_BYTES % width
    part = view[:size]
    started = time.perf_counter()
    planes, tail = split_planes(part, width)
    split_s = time.perf_counter() - started
    comp = codec.compressor()
    mask: list[bool] = []
    payload: list[Buffer] = []
    words: list[int] = []
    spent = split_s
    for plane in planes:
        t0 = time.perf_counter()
        packed = _compress(comp, plane) if len(plane) else b""
        dt = time.perf_counter() - t0
        worth = len(plane) > 0 and len(packed) < INCOMPRESSIBLE * len(plane)
        mask.append(worth)
        if worth:
            spent += dt
            payload.append(packed)
            words.append(len(packed) << 1 | 1)
        else:
            payload.append(plane)
            words.append(len(plane) << 1)
    header_len = width * _WORD.size
    stored = header_len + sum(len(p) for p in payload) + len(tail)
    encoded = None
    if whole and any(mask):
        header = b"".join(_WORD.pack(w) for w in words)
        parts: list[Buffer] = [header, *payload]
        if len(tail):
            parts.append(tail)
        encoded = Encoded(parts, stored, StreamingChecksum(parts).hexdigest(), spent)
    return Sample(width, size, stored, spent, tuple(mask), encoded)


_overhead: float | None = None
_overhead_lock = threading.Lock()


def fixed_overhead_seconds() -> float:
    """Per-chunk fixed cost of encoding (splitting, zstd calls), measured once per process."""
    global _overhead
    if _overhead is None:
        with _overhead_lock:
            if _overhead is None:
                probe = as_bytes(torch.arange(64, dtype=torch.float32))
                codec = PlaneCodec(level=1, threads=0)
                times = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    encode(probe, 4, codec)
                    times.append(time.perf_counter() - t0)
                _overhead = statistics.median(times)
                logger.debug("codec fixed overhead: %.1f us per chunk", _overhead * 1e6)
    return _overhead
