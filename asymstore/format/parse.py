"""Parsing a manifest read from storage: untrusted input, checked before anything is built from it.

See :mod:`asymstore.format.manifest` for the format and the rules (and
``Manifest.to_json`` for the writing side); :func:`parse_manifest` is the one
way from bytes to a :class:`~asymstore.format.manifest.Manifest`.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
from typing import Any

from asymstore.errors import InvalidNameError, ManifestError
from asymstore.format.checksum import ALGORITHM, checksum
from asymstore.format.manifest import (
    CHECKSUM_SUFFIX,
    CHUNK_PROOF_FORMAT_VERSION,
    CODEC_NAME,
    DTYPE_SIZES,
    FORMAT,
    HEX_DIGEST,
    MAX_CHUNK_RAW_BYTES,
    MAX_DIMS,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    READABLE_FORMAT_VERSIONS,
    REFERENCE_FORMAT_VERSION,
    Chunk,
    Manifest,
    SegmentEntry,
    TensorEntry,
    reference_key,
    validate_name,
    validate_names,
    validate_segment_name,
)
from asymstore.format.proof import PROOFS
from asymstore.runtime.gcpause import gc_paused


def parse_manifest(data: bytes | bytearray | memoryview) -> Manifest:
    """Verify the self-checksum, then parse and check every field of manifest bytes.

    The self-checksum (format 2) is verified before anything is parsed; sizes,
    depth, dtypes, shapes and chunk bounds are checked before anything is
    allocated from them.

    Raises:
        ManifestError: the bytes are not a valid, intact manifest of a readable format version.
    """
    data = bytes(data)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    match = CHECKSUM_SUFFIX.search(data, max(0, len(data) - 64))
    if match is not None:
        body = data[:match.start()]
        if checksum(body) != match.group(1).decode():
            raise ManifestError("manifest checksum mismatch: the manifest is damaged")
    with gc_paused():  # tens of thousands of fresh objects would run the cyclic GC over all of them, repeatedly
        try:  # the C decoder raises RecursionError on deep nesting at once; the schema bounds the rest
            doc = json.loads(data, parse_constant=_refuse_constant)
        except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as exc:
            raise ManifestError(f"manifest is not strict JSON: {type(exc).__name__}: {str(exc)[:200]}") from exc
        try:
            return _parse(doc, checksummed=match is not None)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ManifestError(f"malformed manifest: {type(exc).__name__}: {str(exc)[:200]}") from exc


_INT_MAX = 1 << 62


def _refuse_constant(name: str) -> None:
    raise ManifestError(f"manifest holds {name}, which strict JSON has not")


def _check_depth(value: object, what: str) -> None:
    """Refuse free-form JSON (``meta``, ``extra``) nested deeper than MAX_JSON_DEPTH (an iterative walk)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise ManifestError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _INT_MAX:
        raise ManifestError(f"{what} must be a non-negative int below 2**62, got {str(value)[:40]}")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"{what} must be a str, got {value!r}")
    return value


def _parse_chunk(c: Any, owner: str, segments: dict[str, SegmentEntry],
                 spans: dict[str, list[tuple[int, int, str]]]) -> Chunk:
    """Check one chunk (of a tensor, or a pack) and record the stored bytes it claims.

    A chunk with ``step`` (format 4) references that earlier version's segment, which the
    manifest's ``segments`` must list with the same ``step``.
    """
    seg_name = _str(c["segment"], "chunk segment")
    if "step" in c:
        seg_name = reference_key(_int(c["step"], "chunk step"), validate_segment_name(seg_name))
    if seg_name not in segments:
        raise ManifestError(f"chunk of {owner} names unknown segment {seg_name[:140]!r}")
    chunk = Chunk(
        segment=seg_name,
        offset=_int(c["offset"], "offset"),
        length=_int(c["length"], "length"),
        raw_length=_int(c["raw_length"], "raw_length"),
        checksum=_hex(c["checksum"], "checksum"),
        codec=_str(c.get("codec", "raw"), "codec"),
        raw_checksum=_hex(c.get("raw_checksum", c["checksum"]), "raw_checksum"),
    )
    if not CODEC_NAME.match(chunk.codec):
        raise ManifestError(f"chunk of {owner} names unknown codec {chunk.codec[:40]!r}")
    if chunk.codec == "raw" and chunk.length != chunk.raw_length:
        raise ManifestError(f"raw chunk of {owner}: length {chunk.length} != raw_length {chunk.raw_length}")
    if chunk.raw_length > MAX_CHUNK_RAW_BYTES:
        raise ManifestError(f"chunk of {owner} declares {chunk.raw_length} raw bytes, "
                            f"more than the {MAX_CHUNK_RAW_BYTES}-byte limit")
    if chunk.offset + chunk.length > segments[seg_name].size:
        raise ManifestError(f"chunk of {owner} runs past the end of {seg_name}")
    if chunk.length:
        spans[seg_name].append((chunk.offset, chunk.length, owner))
    return chunk


def _parse_tensor(name: str, entry: Any, segments: dict[str, SegmentEntry],
                  spans: dict[str, list[tuple[int, int, str]]]) -> TensorEntry:
    dtype = _str(entry["dtype"], "dtype")
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is None:
        raise ManifestError(f"{name!r}: dtype {dtype[:40]!r} is not a storable dtype")
    if not isinstance(entry["shape"], list) or len(entry["shape"]) > MAX_DIMS:
        raise ManifestError(f"{name!r}: shape must be a list of at most {MAX_DIMS} dims")
    shape = tuple(_int(d, "shape dim") for d in entry["shape"])
    nbytes = _int(entry["nbytes"], "nbytes")
    if math.prod(shape) * itemsize != nbytes:
        raise ManifestError(f"{name!r}: shape {list(shape)} of {dtype} is not {nbytes} bytes")
    chunks = [_parse_chunk(c, repr(name), segments, spans) for c in entry["chunks"]]
    if sum(c.raw_length for c in chunks) != nbytes:
        raise ManifestError(f"chunks of {name!r} do not add up to {nbytes} bytes")
    return TensorEntry(dtype, shape, nbytes, tuple(chunks))


def _column(table: dict[str, Any], key: str, count: int) -> list[Any]:
    column = table[key]
    if not isinstance(column, list) or len(column) != count:
        raise ManifestError(f"packed {key} must be a list of {count} entries")
    return column


def _ints(values: list[Any], what: str) -> None:
    """Every value a non-negative int below 2**62 (checked in bulk)."""
    if values and (not set(map(type, values)) <= {int} or min(values) < 0 or max(values) >= _INT_MAX):
        raise ManifestError(f"{what} must be non-negative ints below 2**62")


def _parse_packed(doc: Any, segments: dict[str, SegmentEntry], spans: dict[str, list[tuple[int, int, str]]],
                  tensors: dict[str, TensorEntry]) -> None:
    """Check the packs and the packed table of a format 3 manifest; add the packed tensors to ``tensors``.

    Every column is checked before any entry is built: names (valid, unique,
    not also chunked), dtypes, shapes, pack indices (in order), and offsets
    (aligned to the item size, inside the pack's raw bytes, increasing without
    overlap within a pack).
    """
    packs_doc = doc["packs"]
    table = doc["packed"]
    if not isinstance(packs_doc, list) or not isinstance(table, dict):
        raise ManifestError("packs must be a list and packed an object")
    packs = [_parse_chunk(c, f"pack {i}", segments, spans) for i, c in enumerate(packs_doc)]
    names = table["names"]
    if not isinstance(names, list):
        raise ManifestError("packed names must be a list")
    count = len(names)
    kinds = _column(table, "dtype", count)
    shapes = _column(table, "shapes", count)
    where = _column(table, "pack", count)
    offsets = _column(table, "offsets", count)
    dtypes = table["dtypes"]
    if not isinstance(dtypes, list) or len(dtypes) > len(DTYPE_SIZES):
        raise ManifestError("packed dtypes must be a list of storable dtypes")
    itemsizes = []
    for dtype in dtypes:
        size = DTYPE_SIZES.get(_str(dtype, "dtype"))
        if size is None:
            raise ManifestError(f"packed dtype {dtype[:40]!r} is not a storable dtype")
        itemsizes.append(size)
    _ints(kinds, "packed dtype indices")
    _ints(where, "packed pack indices")
    _ints(offsets, "packed offsets")
    if kinds and max(kinds) >= len(dtypes):
        raise ManifestError("a packed dtype index names no dtype")
    if where and max(where) >= len(packs):
        raise ManifestError("a packed pack index names no pack")
    if not set(map(type, shapes)) <= {list}:
        raise ManifestError("packed shapes must be lists")
    if shapes and max(map(len, shapes)) > MAX_DIMS:
        raise ManifestError(f"a packed shape has more than {MAX_DIMS} dims")
    _ints(list(itertools.chain.from_iterable(shapes)), "shape dims")
    if not set(map(type, names)) <= {str}:
        raise ManifestError("packed names must be strs")
    if len(set(names)) != count or not tensors.keys().isdisjoint(names):
        raise ManifestError("a packed tensor name is listed twice")
    try:
        validate_names(names)
    except InvalidNameError as exc:
        raise ManifestError(str(exc)) from exc
    # every rule checked column-wise (C loops over the lists), then the entries built in one pass
    sizes = list(map(itemsizes.__getitem__, kinds))
    nbytes = list(map(operator.mul, map(math.prod, shapes), sizes))
    ends = list(map(operator.add, offsets, nbytes))
    limits = list(map([c.raw_length for c in packs].__getitem__, where))
    bad = (any(map(operator.mod, offsets, sizes)) or any(map(operator.gt, ends, limits))
           or any(map(operator.lt, where[1:], where[:-1]))
           or any(map(operator.and_, map(operator.eq, where[1:], where[:-1]), map(operator.lt, offsets[1:], ends))))
    if bad:
        for i, name in enumerate(names):
            if offsets[i] % sizes[i] or ends[i] > limits[i] or (i and (where[i] < where[i - 1] or (
                    where[i] == where[i - 1] and offsets[i] < ends[i - 1]))):
                raise ManifestError(f"packed {name!r}: offset {offsets[i]} in pack {where[i]} is misaligned, runs "
                                    "past the pack's end, or is not after the tensor before it")
    chunks = [(c,) for c in packs]
    tensors.update(zip(names, map(TensorEntry, map(dtypes.__getitem__, kinds), map(tuple, shapes), nbytes,
                                  map(chunks.__getitem__, where), offsets), strict=True))


def _hex(value: object, what: str) -> str:
    text = _str(value, what)
    if not HEX_DIGEST.fullmatch(text):
        raise ManifestError(f"{what} must be a hex digest, got {text[:40]!r}")
    return text


def _parse(doc: Any, *, checksummed: bool) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError("not an asymstore manifest")
    version = doc.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        raise ManifestError(f"unsupported manifest format_version {str(version)[:20]} (this asymstore reads "
                            f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))})")
    if version >= 2 and not checksummed:
        raise ManifestError(f"format_version {version} manifest without its self-checksum: the manifest is damaged")
    if doc.get("checksum_algorithm") != ALGORITHM:
        raise ManifestError(f"unsupported checksum algorithm {doc.get('checksum_algorithm')!r}")
    step = _int(doc["step"], "step")
    segments: dict[str, SegmentEntry] = {}
    for seg in doc["segments"]:
        name = validate_segment_name(seg["name"])
        origin: int | None = None
        if "step" in seg:  # format 4: a segment of an earlier version that holds chunks of this one
            if version < REFERENCE_FORMAT_VERSION:
                raise ManifestError(f"format_version {version} manifest references another version's segment")
            origin = _int(seg["step"], "segment step")
            if origin >= step:
                raise ManifestError(f"segment {name} of step {origin} referenced by step {step}: "
                                    "a version references only earlier ones")
            name = reference_key(origin, name)
        if name in segments:
            raise ManifestError(f"segment {name} listed twice")
        proof = seg.get("proof", "bytes")
        if proof != "bytes" and (version < CHUNK_PROOF_FORMAT_VERSION or proof not in PROOFS):
            raise ManifestError(f"segment {name}: proof {str(proof)[:20]!r} in a format_version {version} manifest")
        segments[name] = SegmentEntry(name, _int(seg["size"], "segment size"), _hex(seg["checksum"], "checksum"),
                                      origin, proof)
    tensors: dict[str, TensorEntry] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {name: [] for name in segments}
    for name, entry in doc["tensors"].items():
        try:
            validate_name(name)
        except InvalidNameError as exc:
            raise ManifestError(str(exc)) from exc
        tensors[name] = _parse_tensor(name, entry, segments, spans)
    if version >= 3 and ("packs" in doc or "packed" in doc):
        _parse_packed(doc, segments, spans, tensors)
    elif "packs" in doc or "packed" in doc:
        raise ManifestError(f"format_version {version} manifest with packed tensors (format 3)")
    for seg_name, used in spans.items():  # one stored byte belongs to at most one chunk
        used.sort()
        for (a_off, a_len, a_name), (b_off, _, b_name) in itertools.pairwise(used):
            if b_off < a_off + a_len:
                raise ManifestError(f"chunks of {a_name!r} and {b_name!r} overlap in {seg_name} at {b_off}")
    meta = doc.get("meta", {})
    extra = doc.get("extra", {})
    if not isinstance(meta, dict) or not isinstance(extra, dict):
        raise ManifestError("meta and extra must be JSON objects")
    _check_depth(meta, "meta")
    _check_depth(extra, "extra")
    created = doc.get("created", 0.0)
    if not isinstance(created, (int, float)) or not math.isfinite(created):
        raise ManifestError("created must be a number")
    return Manifest(
        step=step,
        tensors=tensors,
        segments=tuple(segments.values()),
        meta=meta,
        created=float(created),
        extra=extra,
    )
