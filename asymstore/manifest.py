"""The manifest: the JSON description of one checkpoint version (pure data, no I/O).

A version exists on a tier only once its manifest is published there. The
manifest lists every tensor (dtype, shape, chunks), every segment file (size,
checksum) and the user's JSON metadata. Schema (format version 1)::

    {
      "format": "asymstore.manifest", "format_version": 1,
      "step": 12, "created": 1763776000.5, "checksum_algorithm": "xxh3_64",
      "meta": {...user JSON...},
      "segments": [{"name": "seg-000000.bin", "size": 4096, "checksum": "hex"}],
      "tensors": {
        "layers.0.weight": {
          "dtype": "bfloat16", "shape": [4, 4], "nbytes": 32,
          "chunks": [{"segment": "seg-000000.bin", "offset": 0, "length": 32,
                      "raw_length": 32, "codec": "raw", "checksum": "hex",
                      "raw_checksum": "hex"}]
        }
      },
      "extra": {...asymstore-internal JSON, e.g. rank layout...}
    }

``checksum`` covers the stored bytes of a chunk, ``raw_checksum`` the bytes
after decoding (equal for the ``raw`` codec).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from asymstore.checksum import ALGORITHM
from asymstore.errors import InvalidMetaError, InvalidNameError, ManifestError

FORMAT = "asymstore.manifest"
FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
_jstr = encode_basestring_ascii  # a str as a JSON string literal, as json.dumps writes it
_SEGMENT_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")


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
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:[\\/]", name):
        raise InvalidNameError(f"tensor name is absolute: {name!r}")
    if ".." in re.split(r"[\\/]", name):
        raise InvalidNameError(f"tensor name contains '..': {name!r}")
    return name


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
        """Return the JSON object for this chunk."""
        return {
            "segment": self.segment,
            "offset": self.offset,
            "length": self.length,
            "raw_length": self.raw_length,
            "codec": self.codec,
            "checksum": self.checksum,
            "raw_checksum": self.raw_checksum or self.checksum,
        }

    def json_text(self) -> str:
        """Return :meth:`to_json` serialized (compact), without building the dict."""
        return (f'{{"segment":{_jstr(self.segment)},"offset":{int(self.offset)},"length":{int(self.length)},'
                f'"raw_length":{int(self.raw_length)},"codec":{_jstr(self.codec)},'
                f'"checksum":{_jstr(self.checksum)},"raw_checksum":{_jstr(self.raw_checksum or self.checksum)}}}')


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One stored tensor: dtype name, shape and its chunks in byte order."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: tuple[Chunk, ...]

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object for this tensor."""
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "chunks": [c.to_json() for c in self.chunks],
        }

    def json_text(self) -> str:
        """Return :meth:`to_json` serialized (compact), without building the dict."""
        shape = ",".join(str(int(d)) for d in self.shape)
        chunks = ",".join(c.json_text() for c in self.chunks)
        return f'{{"dtype":{_jstr(self.dtype)},"shape":[{shape}],"nbytes":{int(self.nbytes)},"chunks":[{chunks}]}}'


@dataclass(frozen=True, slots=True)
class SegmentEntry:
    """One segment file of a version."""

    name: str
    size: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object for this segment."""
        return {"name": self.name, "size": self.size, "checksum": self.checksum}


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
        """Bytes of all segment files."""
        return sum(s.size for s in self.segments)

    def to_json(self) -> bytes:
        """Serialize to UTF-8 JSON bytes.

        The tensors, which can number tens of thousands, are written straight
        to text (no intermediate dicts for the garbage collector to scan).
        """
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "created": self.created,
            "checksum_algorithm": ALGORITHM,
            "meta": self.meta,
            "segments": [s.to_json() for s in self.segments],
        }
        head = json.dumps(doc, allow_nan=False, separators=(",", ":"))
        tensors = ",".join(f"{_jstr(name)}:{t.json_text()}" for name, t in self.tensors.items())
        extra = json.dumps(self.extra, allow_nan=False, separators=(",", ":"))
        return f'{head[:-1]},"tensors":{{{tensors}}},"extra":{extra}}}'.encode()

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview) -> Manifest:
        """Parse and validate manifest bytes.

        Raises:
            ManifestError: the bytes are not a valid manifest of a known version.
        """
        try:
            doc = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from exc
        try:
            return _parse(doc)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"malformed manifest: {exc!r}") from exc


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"{what} must be a str, got {value!r}")
    return value


def _parse(doc: Any) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError("not an asymstore manifest")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"unsupported manifest format_version {doc.get('format_version')!r}")
    if doc.get("checksum_algorithm") != ALGORITHM:
        raise ManifestError(f"unsupported checksum algorithm {doc.get('checksum_algorithm')!r}")
    segments: dict[str, SegmentEntry] = {}
    for seg in doc["segments"]:
        name = validate_segment_name(seg["name"])
        if name in segments:
            raise ManifestError(f"segment {name} listed twice")
        segments[name] = SegmentEntry(name, _int(seg["size"], "segment size"), _str(seg["checksum"], "checksum"))
    tensors: dict[str, TensorEntry] = {}
    for name, entry in doc["tensors"].items():
        try:
            validate_name(name)
        except InvalidNameError as exc:
            raise ManifestError(str(exc)) from exc
        chunks = []
        for c in entry["chunks"]:
            seg_name = _str(c["segment"], "chunk segment")
            if seg_name not in segments:
                raise ManifestError(f"chunk of {name!r} names unknown segment {seg_name!r}")
            chunk = Chunk(
                segment=seg_name,
                offset=_int(c["offset"], "offset"),
                length=_int(c["length"], "length"),
                raw_length=_int(c["raw_length"], "raw_length"),
                checksum=_str(c["checksum"], "checksum"),
                codec=_str(c.get("codec", "raw"), "codec"),
                raw_checksum=_str(c.get("raw_checksum", c["checksum"]), "raw_checksum"),
            )
            if chunk.offset + chunk.length > segments[seg_name].size:
                raise ManifestError(f"chunk of {name!r} runs past the end of {seg_name}")
            chunks.append(chunk)
        shape = tuple(_int(d, "shape dim") for d in entry["shape"])
        nbytes = _int(entry["nbytes"], "nbytes")
        if sum(c.raw_length for c in chunks) != nbytes:
            raise ManifestError(f"chunks of {name!r} do not add up to {nbytes} bytes")
        tensors[name] = TensorEntry(_str(entry["dtype"], "dtype"), shape, nbytes, tuple(chunks))
    meta = doc.get("meta", {})
    extra = doc.get("extra", {})
    if not isinstance(meta, dict) or not isinstance(extra, dict):
        raise ManifestError("meta and extra must be JSON objects")
    created = doc.get("created", 0.0)
    if not isinstance(created, (int, float)) or not math.isfinite(created):
        raise ManifestError("created must be a number")
    return Manifest(
        step=_int(doc["step"], "step"),
        tensors=tensors,
        segments=tuple(segments.values()),
        meta=meta,
        created=float(created),
        extra=extra,
    )
