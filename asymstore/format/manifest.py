"""The manifest: the JSON description of one checkpoint version (pure data, no I/O).

A version exists on a tier only once its manifest is published there. The manifest lists every
tensor (dtype, shape, chunks; format version 3 adds packs of small tensors, listed as columns),
every segment file (size, checksum), the user's JSON metadata, and ends with a checksum of itself
(format version 2), verified before any field is read. ``checksum`` covers a chunk's stored bytes,
``raw_checksum`` its decoded bytes. A packed tensor is a :class:`TensorEntry` whose one chunk is
its pack (:meth:`TensorEntry.pieces`). Every manifest read is untrusted input: at most
:data:`MAX_MANIFEST_BYTES` and :data:`MAX_JSON_DEPTH` levels, only the dtypes of
:data:`DTYPE_SIZES`, ``prod(shape) * itemsize == nbytes``, chunks inside their segment and not
overlapping, none declaring more than :data:`MAX_CHUNK_RAW_BYTES`.

The schema, packs and the self-checksum: docs/concepts/format.md.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from asymstore.errors import InvalidMetaError, InvalidNameError, ManifestError
from asymstore.format.checksum import ALGORITHM, checksum
from asymstore.format.proof import SegmentProof, Span

FORMAT = "asymstore.manifest"
FORMAT_VERSION = 2
"""Written for versions without packed tensors (readable by every asymstore since 0.2)."""
PACKED_FORMAT_VERSION = 3
"""Written for versions that hold packed tensors (``packs`` and ``packed``)."""
REFERENCE_FORMAT_VERSION = 4
"""Written for versions with chunks referenced from an earlier version's segments (packs may be there too)."""
CHUNK_PROOF_FORMAT_VERSION = 5
"""Written for versions with a segment proved by its chunks' checksums (:mod:`asymstore.format.proof`;
references and packs may be there too)."""
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5)
MANIFEST_NAME = "MANIFEST.json"
MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest read (about 200,000 single-chunk tensors); a larger file is refused unread."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of JSON arrays and objects accepted (user ``meta`` included)."""
MAX_CHUNK_RAW_BYTES = 1 << 30
"""Largest raw length one chunk may declare (the store never writes chunks larger)."""
MAX_DIMS = 64
DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    **{f"{kind}{bits}": 1 for kind in ("int", "uint") for bits in range(1, 8)},
}
"""Storable dtypes (torch names) and their item sizes; quantized and opaque ``bits`` dtypes are not storable."""
CODEC_NAME = re.compile(r"^(raw|zstd-planes:[1248])$")
HEX_DIGEST = re.compile(r"[0-9a-f]{1,64}")
_DRIVE = re.compile(r"[A-Za-z]:[\\/]")
_SEPARATORS = re.compile(r"[\\/]")
CHECKSUM_SUFFIX = re.compile(rb',"manifest_checksum":"([0-9a-f]{16})"\}\s*$')
_jstr = encode_basestring_ascii  # a str as a JSON string literal, as json.dumps writes it
_SEGMENT_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
_REF_SEP = "@"  # never in a segment file name: a referenced segment's key cannot be taken for a file of the version


def reference_key(step: int, name: str) -> str:
    """The in-memory key of segment ``name`` of an earlier version ``step`` (format 4 references).

    A :class:`Chunk` and a :class:`SegmentEntry` name a referenced segment by
    this key (``seg-000000.bin@12``), so every table keyed by segment stays
    unique; the JSON keeps the file name and the step apart. A key is no valid
    segment file name, so a reader that passed it to a tier unresolved would
    get an error, never another file: resolve it with :meth:`Manifest.locate`.
    """
    return f"{name}{_REF_SEP}{step}"


def split_key(key: str) -> tuple[int | None, str]:
    """``(step, file name)`` of a segment key: step None for the version's own segment."""
    name, sep, step = key.rpartition(_REF_SEP)
    if not sep:
        return None, key
    return int(step), name


def seal(body: bytes) -> bytes:
    """Close the JSON object text ``body`` (all of it but the final ``}``) with its self-checksum."""
    return body + b',"manifest_checksum":"' + checksum(body).encode() + b'"}'


def seal_document(doc: dict[str, Any]) -> bytes:
    """Serialize a manifest document (as parsed JSON) and seal it; a ``manifest_checksum`` key in it is replaced.

    For tools and fault-injection tests that edit a manifest on purpose; the
    store itself writes through :meth:`Manifest.to_json`.
    """
    body = {k: v for k, v in doc.items() if k != "manifest_checksum"}
    return seal(json.dumps(body, allow_nan=False, separators=(",", ":")).encode()[:-1])


def validate_name(name: object) -> str:
    """Check a tensor name and return it.

    Names are manifest keys, never file names, but they are still held to the
    rules users expect of paths: non-empty str, not absolute, no ``..``
    component, no NUL.

    Raises:
        InvalidNameError: the name breaks one of the rules.
    """
    if not isinstance(name, str):
        raise InvalidNameError(f"tensor name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidNameError("tensor name is empty")
    if "\x00" in name:
        raise InvalidNameError(f"tensor name contains NUL: {name!r}")
    if name[0] in "/\\" or (len(name) > 2 and name[1] == ":" and _DRIVE.match(name)):
        raise InvalidNameError(f"tensor name is absolute: {name!r}")
    if ".." in name and ".." in _SEPARATORS.split(name):
        raise InvalidNameError(f"tensor name contains '..': {name!r}")
    return name


_DRIVE_IN_JOINED = re.compile(r"(?:^|\x00)[A-Za-z]:[\\/]")
_DOTDOT_IN_JOINED = re.compile(r"(?:^|[\x00/\\])\.\.(?=[\x00/\\]|\Z)")


def validate_names(names: Sequence[object]) -> None:
    """Check many tensor names at once, by :func:`validate_name`'s rules (one pass over them joined).

    Raises:
        InvalidNameError: for the first name that breaks a rule, as :func:`validate_name` would.
    """
    if not names:
        return
    if set(map(type, names)) <= {str}:
        joined = "\x00".join(names)  # type: ignore[arg-type]
        if (joined.count("\x00") == len(names) - 1  # no NUL in a name
                and joined and joined[0] not in "\x00/\\" and joined[-1] != "\x00"  # first not empty or absolute
                and "\x00\x00" not in joined and "\x00/" not in joined and "\x00\\" not in joined
                and not (":" in joined and _DRIVE_IN_JOINED.search(joined))
                and not (".." in joined and _DOTDOT_IN_JOINED.search(joined))):
            return
    for name in names:  # one of them is bad: find it, and raise its error
        validate_name(name)


def validate_segment_name(name: object) -> str:
    """Check a segment file name (a plain file name inside one version)."""
    if not isinstance(name, str) or not _SEGMENT_NAME.match(name) or name == MANIFEST_NAME:
        raise ManifestError(f"bad segment name {name!r}")
    return name


def validate_meta(meta: object) -> dict[str, Any]:
    """Return ``meta`` if it is strict JSON (a dict with str keys, finite numbers).

    Raises:
        InvalidMetaError: it is not.
    """
    if meta is None:
        return {}
    if isinstance(meta, Mapping) and not isinstance(meta, dict):
        meta = dict(meta)
    if not isinstance(meta, dict):
        raise InvalidMetaError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        text = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidMetaError(f"meta is not strict JSON: {exc}") from exc
    result: dict[str, Any] = json.loads(text)
    if result != meta:
        raise InvalidMetaError("meta does not survive a JSON round trip (non-str keys or tuples?)")
    return result


@dataclass(frozen=True, slots=True)
class Chunk:
    """A contiguous piece of one tensor's bytes inside one segment."""

    segment: str
    offset: int
    length: int
    raw_length: int
    checksum: str
    codec: str = "raw"
    raw_checksum: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object for this chunk (a referenced one names its segment's version as ``step``)."""
        origin, name = split_key(self.segment)
        out: dict[str, Any] = {"segment": name}
        if origin is not None:
            out["step"] = origin
        out.update({
            "offset": self.offset,
            "length": self.length,
            "raw_length": self.raw_length,
            "codec": self.codec,
            "checksum": self.checksum,
            "raw_checksum": self.raw_checksum or self.checksum,
        })
        return out

    def json_text(self) -> str:
        """Return :meth:`to_json` serialized (compact), without building the dict."""
        if _REF_SEP in self.segment:
            origin, name = split_key(self.segment)
            return (f'{{"segment":{_jstr(name)},"step":{int(origin or 0)},"offset":{int(self.offset)},'
                    f'"length":{int(self.length)},"raw_length":{int(self.raw_length)},"codec":{_jstr(self.codec)},'
                    f'"checksum":{_jstr(self.checksum)},"raw_checksum":{_jstr(self.raw_checksum or self.checksum)}}}')
        return (f'{{"segment":{_jstr(self.segment)},"offset":{int(self.offset)},"length":{int(self.length)},'
                f'"raw_length":{int(self.raw_length)},"codec":{_jstr(self.codec)},'
                f'"checksum":{_jstr(self.checksum)},"raw_checksum":{_jstr(self.raw_checksum or self.checksum)}}}')


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One stored tensor: dtype name, shape and its chunks in byte order.

    A packed tensor (format 3) has one chunk, its pack, and ``pack_offset``
    set: its bytes are ``[pack_offset, pack_offset + nbytes)`` of the pack's
    raw bytes. :meth:`pieces` gives both kinds in one form.
    """

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: tuple[Chunk, ...]
    pack_offset: int | None = None

    def pieces(self) -> list[tuple[Chunk, int, int]]:
        """The tensor's bytes in order, as ``(chunk, start, stop)`` ranges of each chunk's raw bytes.

        A chunk of its own is ``(chunk, 0, chunk.raw_length)``; a packed tensor is
        one range of its pack. Reading a range means verifying (and decoding) the
        whole chunk first.
        """
        if self.pack_offset is not None:
            return [(self.chunks[0], self.pack_offset, self.pack_offset + self.nbytes)]
        return [(c, 0, c.raw_length) for c in self.chunks]

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object for this tensor (as a chunked tensor: packed ones are listed in columns)."""
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "chunks": [c.to_json() for c in self.chunks],
        }

    def json_text(self) -> str:
        """Return :meth:`to_json` serialized (compact), without building the dict (chunked tensors only)."""
        shape = ",".join(str(int(d)) for d in self.shape)
        chunks = ",".join(c.json_text() for c in self.chunks)
        return f'{{"dtype":{_jstr(self.dtype)},"shape":[{shape}],"nbytes":{int(self.nbytes)},"chunks":[{chunks}]}}'


@dataclass(frozen=True, slots=True)
class SegmentEntry:
    """One segment file of a version."""

    name: str
    size: int
    checksum: str
    origin: int | None = None
    """The earlier version whose segment this is (format 4; ``name`` is then its :func:`reference_key`), or None."""
    proof: SegmentProof = "bytes"
    """What ``checksum`` is taken over: the segment's bytes, or its chunks (format 5, :mod:`asymstore.format.proof`)."""

    @property
    def file(self) -> str:
        """The segment's file name in its version (``origin``'s, or this one's)."""
        return split_key(self.name)[1]

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object for this segment."""
        out: dict[str, Any] = ({"name": self.name} if self.origin is None else
                               {"name": self.file, "step": self.origin})
        out.update({"size": self.size, "checksum": self.checksum})
        if self.proof != "bytes":
            out["proof"] = self.proof
        return out


@dataclass(frozen=True)
class Manifest:
    """The complete description of one version."""

    step: int
    tensors: dict[str, TensorEntry]
    segments: tuple[SegmentEntry, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Raw bytes of all tensors."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def stored_bytes(self) -> int:
        """Bytes of all segment files (referenced ones of earlier versions included)."""
        return sum(s.size for s in self.segments)

    @property
    def written_bytes(self) -> int:
        """Bytes of this version's own segment files (those it wrote; references left out)."""
        return sum(s.size for s in self.segments if s.origin is None)

    def locate(self, segment: str) -> tuple[int, str]:
        """``(step, file name)`` where segment ``segment`` (a key of :attr:`segments`) is read from a tier."""
        origin, name = split_key(segment)
        return (self.step if origin is None else origin), name

    @functools.cached_property
    def references(self) -> dict[int, frozenset[str]]:
        """Earlier version -> its segment files this version's chunks reference (empty below format 4)."""
        out: dict[int, set[str]] = {}
        for s in self.segments:
            if s.origin is not None:
                out.setdefault(s.origin, set()).add(s.file)
        return {step: frozenset(names) for step, names in sorted(out.items())}

    @functools.cached_property
    def packs(self) -> tuple[Chunk, ...]:
        """The packs of the packed tensors, in order of first use (empty below format 3)."""
        seen: dict[Chunk, None] = {}  # by value, not by place: an empty pack shares its offset with what follows
        for t in self.tensors.values():
            if t.pack_offset is not None:
                seen.setdefault(t.chunks[0])
        return tuple(seen)

    def segment_spans(self, segment: str) -> list[Span]:
        """The spans this version's chunks (packs once) occupy in ``segment`` (its key: a referenced one's too)."""
        out: set[Span] = set()
        for entry in self.tensors.values():
            for c in entry.chunks:
                if c.segment == segment:
                    out.add((c.offset, c.length, c.checksum))
        return sorted(out)

    def to_json(self) -> bytes:
        """Serialize to UTF-8 JSON bytes.

        The tensors, which can number tens of thousands, are written straight
        to text (no intermediate dicts for the garbage collector to scan).
        """
        packed = self._packed_columns()
        doc = {
            "format": FORMAT,
            "format_version": (CHUNK_PROOF_FORMAT_VERSION if any(s.proof != "bytes" for s in self.segments) else
                               REFERENCE_FORMAT_VERSION if self.references else
                               FORMAT_VERSION if packed is None else PACKED_FORMAT_VERSION),
            "step": self.step,
            "created": self.created,
            "checksum_algorithm": ALGORITHM,
            "meta": self.meta,
            "segments": [s.to_json() for s in self.segments],
        }
        head = json.dumps(doc, allow_nan=False, separators=(",", ":"))
        tensors = ",".join(f"{_jstr(name)}:{t.json_text()}" for name, t in self.tensors.items()
                           if t.pack_offset is None)
        extra = json.dumps(self.extra, allow_nan=False, separators=(",", ":"))
        packs = ""
        if packed is not None:
            packs = (f',"packs":[{",".join(c.json_text() for c in self.packs)}],'
                     f'"packed":{json.dumps(packed, allow_nan=False, separators=(",", ":"))}')
        return seal(f'{head[:-1]},"tensors":{{{tensors}}}{packs},"extra":{extra}'.encode())

    def _packed_columns(self) -> dict[str, list[Any]] | None:
        """The ``packed`` table of format 3 (None when no tensor is packed)."""
        packs = self.packs
        if not packs:
            return None
        pack_index = {c: i for i, c in enumerate(packs)}
        dtypes: dict[str, int] = {}
        names: list[str] = []
        kinds: list[int] = []
        shapes: list[tuple[int, ...]] = []
        where: list[int] = []
        offsets: list[int] = []
        for name, t in self.tensors.items():
            if t.pack_offset is None:
                continue
            c = t.chunks[0]
            kind = dtypes.get(t.dtype)
            if kind is None:
                kind = dtypes[t.dtype] = len(dtypes)
            names.append(name)
            kinds.append(kind)
            shapes.append(t.shape)
            where.append(pack_index[c])
            offsets.append(t.pack_offset)
        order = list(zip(where, offsets, strict=True))
        if any(a > b for a, b in itertools.pairwise(order)):  # the table lists each pack's tensors in place order
            rank = sorted(range(len(order)), key=order.__getitem__)
            names = [names[i] for i in rank]
            kinds = [kinds[i] for i in rank]
            shapes = [shapes[i] for i in rank]
            where = [where[i] for i in rank]
            offsets = [offsets[i] for i in rank]
        return {"dtypes": list(dtypes), "names": names, "dtype": kinds, "shapes": shapes, "pack": where,
                "offsets": offsets}
