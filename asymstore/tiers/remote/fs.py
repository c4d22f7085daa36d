"""pyarrow filesystem plumbing of :class:`~asymstore.tiers.remote.tier.RemoteTier`: opening a URI, whole-object I/O."""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import pyarrow.fs as pafs

from asymstore.errors import CorruptVersionError
from asymstore.tiers.protocol import Buffer

_MAP_MIN_BYTES = 1 << 20  # reads at least this large land in an anonymous mapping
_S3_KEYS = {"endpoint_override", "scheme", "region", "access_key", "secret_key", "session_token",
            "allow_bucket_creation", "force_virtual_addressing", "connect_timeout", "request_timeout"}


def open_filesystem(uri: str, **options: Any) -> tuple[pafs.FileSystem, str, str]:
    """Return ``(filesystem, root path, scheme)`` for ``uri``; ``options`` override URI query options."""
    parts = urlsplit(uri)
    scheme = parts.scheme or "file"
    if scheme == "s3":
        opts: dict[str, Any] = dict(parse_qsl(parts.query))
        opts.update(options)
        unknown = set(opts) - _S3_KEYS
        if unknown:
            raise ValueError(f"unknown S3 options {sorted(unknown)}")
        for key in ("connect_timeout", "request_timeout"):
            if key in opts:
                opts[key] = float(opts[key])
        fs = pafs.S3FileSystem(**opts)
        return fs, f"{parts.netloc}{parts.path}".rstrip("/"), scheme
    if options:
        raise ValueError(f"keyword options are only understood for s3:// URIs, got {sorted(options)}")
    if scheme == "hdfs":
        fs, path = pafs.HadoopFileSystem.from_uri(urlunsplit(parts))
        return fs, path.rstrip("/") or "/", scheme
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/") or "/", scheme


def write_all(fs: pafs.FileSystem, path: str, parts: Sequence[Buffer], part_size: int) -> None:
    """Write ``parts`` as one object at ``path``, in writes of at most ``part_size`` bytes."""
    with fs.open_output_stream(path, buffer_size=None, metadata=None) as out:
        for part in parts:
            view = memoryview(part).cast("B") if len(part) else memoryview(b"")
            for off in range(0, len(view), part_size):
                out.write(view[off:off + part_size])


def read_all(fs: pafs.FileSystem, path: str, *, expected_size: int | None = None,
             max_size: int | None = None) -> bytearray | memoryview:
    """Read the whole object at ``path`` with sized reads (never the slow default stream).

    Raises:
        CorruptVersionError: its size is not ``expected_size``, or exceeds ``max_size`` (checked before reading).
    """
    with fs.open_input_file(path) as f:
        size = f.size()
        if expected_size is not None and size != expected_size:
            raise CorruptVersionError(f"{path} has {size} bytes, the manifest says {expected_size}")
        if max_size is not None and size > max_size:
            raise CorruptVersionError(f"{path} has {size} bytes, more than the {max_size} accepted")
        # a large buffer is a fresh private mapping, not bytearray(size), whose zero-fill pass costs as much as the read
        buf: bytearray | memoryview = bytearray(size) if size < _MAP_MIN_BYTES else memoryview(
            mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        view = memoryview(buf)
        done = 0
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{path}: short read ({done} of {size} bytes)")
            done += n
        return buf
