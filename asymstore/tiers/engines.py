"""I/O engines for NVMeTier: kvikio (GDS or its POSIX compat mode) and a POSIX fallback.

Both write a whole segment file from a list of buffers and read it back, and
both produce byte-identical files, so either can read what the other wrote.

- :class:`KvikioEngine` uses ``kvikio.CuFile``: GPUDirect Storage when cuFile
  works (device buffers go straight to the NVMe), kvikio's compat (POSIX) mode
  otherwise, with kvikio's own thread pool (``num_threads``, ``task_size``).
- :class:`PosixEngine` splits the file into ``task_size`` blocks written with
  ``pwrite`` from a thread pool, with ``O_DIRECT`` through 4 KiB-aligned bounce
  buffers where the filesystem allows it (buffered ``pwritev`` otherwise), and
  reads with ``preadv`` into page-aligned memory.

kvikio needs ``libcuda.so.1`` even in compat mode and even for host buffers;
where it is missing :func:`select_engine` falls back to POSIX and logs it once.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from asymstore.io.files import address_of, fsync_file
from asymstore.tiers.protocol import Buffer

logger = logging.getLogger(__name__)

ALIGN = 4096
_warned: set[str] = set()
_bounce = threading.local()  # PosixEngine's O_DIRECT bounce buffer, one per pool thread


class Engine(Protocol):
    """Writes and reads whole segment files."""

    name: str

    def write(self, path: str, parts: Sequence[Buffer], *, fsync: bool) -> int:
        """Create ``path`` (must not exist) from ``parts``; return its size."""
        ...

    def read(self, path: str) -> Buffer:
        """Return the whole content of ``path``."""
        ...


def _blocks(size: int, task: int) -> list[tuple[int, int]]:
    return [(off, min(task, size - off)) for off in range(0, size, task)]


def _gather(parts: Sequence[memoryview], starts: list[int], off: int, dest: memoryview) -> None:
    """Copy bytes ``[off, off+len(dest))`` of the concatenated ``parts`` into ``dest``."""
    pos = 0
    for part, start in zip(parts, starts, strict=True):
        end = start + len(part)
        if end <= off or pos >= len(dest):
            continue
        if start >= off + len(dest):
            break
        lo = max(off, start) - start
        n = min(len(part) - lo, len(dest) - pos)
        dest[pos:pos + n] = part[lo:lo + n]
        pos += n


def _pieces(parts: Sequence[memoryview], starts: list[int], off: int, n: int) -> list[tuple[memoryview, int]]:
    """The slices of the concatenated ``parts`` covering bytes ``[off, off+n)``, with their file offsets."""
    out = []
    for part, start in zip(parts, starts, strict=True):
        end = start + len(part)
        if end <= off:
            continue
        if start >= off + n:
            break
        lo, hi = max(off, start) - start, min(off + n, end) - start
        out.append((part[lo:hi], start + lo))
    return out


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


class PosixEngine:
    """pwrite/preadv from a thread pool, O_DIRECT where the filesystem allows.

    Args:
        num_threads: concurrent block writes/reads.
        task_size: bytes per block (rounded up to 4 KiB).
        direct: try O_DIRECT (falls back to buffered I/O where refused).
    """

    name = "posix"

    def __init__(self, num_threads: int = 4, task_size: int = 16 << 20, direct: bool = True) -> None:
        """Configure the engine; the pool starts on first use."""
        self.num_threads = max(1, num_threads)
        self.task_size = -(-task_size // ALIGN) * ALIGN
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="asym-posix")

    def _open_write(self, path: str) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != 22:  # EINVAL: the filesystem refuses O_DIRECT (tmpfs)
                    raise
                _log_once(f"direct:{os.path.dirname(path)}", "O_DIRECT refused under %s; buffered I/O",
                          os.path.dirname(path))
        return os.open(path, flags, 0o644), False

    def write(self, path: str, parts: Sequence[Buffer], *, fsync: bool) -> int:
        """Write ``parts`` to a new file; see the class docstring."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        starts, size = [], 0
        for v in views:
            starts.append(size)
            size += len(v)
        fd, direct = self._open_write(path)
        try:
            if direct:
                list(self._pool.map(lambda b: self._write_block(fd, views, starts, *b),
                                    _blocks(size, self.task_size)))
                os.ftruncate(fd, size)  # the last block was padded to 4 KiB
            else:
                list(self._pool.map(lambda b: self._write_buffered(fd, views, starts, *b),
                                    _blocks(size, self.task_size)))
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return size

    @staticmethod
    def _write_block(fd: int, views: list[memoryview], starts: list[int], off: int, n: int) -> None:
        """Write bytes ``[off, off+n)`` with O_DIRECT: page-aligned parts from their own memory, the rest gathered."""
        # one page-aligned private bounce buffer per pool thread, reused: a fresh mapping per block
        # page-faults (and zeroes) every page again, which costs more CPU than the write itself
        padded = -(-n // ALIGN) * ALIGN
        buf: mmap.mmap | None = getattr(_bounce, "buf", None)
        if buf is None or len(buf) < padded:
            buf = _bounce.buf = mmap.mmap(-1, padded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        dest = memoryview(buf)
        try:
            filled = 0  # bytes gathered, to land at file offset ``at``
            at = off
            for piece, pos in _pieces(views, starts, off, n):
                if filled % ALIGN == 0 and pos % ALIGN == 0 and len(piece) >= ALIGN:
                    address = address_of(piece)
                    if address is not None and address % ALIGN == 0:
                        _pwrite_all(fd, dest[:filled], at)
                        whole = len(piece) - len(piece) % ALIGN
                        _pwrite_all(fd, piece[:whole], pos)  # straight from the caller's pages
                        piece, pos, filled = piece[whole:], pos + whole, 0
                        if not piece:
                            continue
                if not filled:
                    at = pos
                dest[filled:filled + len(piece)] = piece
                filled += len(piece)
            end = -(-filled // ALIGN) * ALIGN
            dest[filled:end] = bytes(end - filled)  # the padding past the end is zeros (truncated away after)
            _pwrite_all(fd, dest[:end], at)
        finally:
            dest.release()

    @staticmethod
    def _write_buffered(fd: int, views: list[memoryview], starts: list[int], off: int, n: int) -> None:
        chunk = bytearray(n)
        _gather(views, starts, off, memoryview(chunk))
        done = 0
        while done < n:
            done += os.pwrite(fd, memoryview(chunk)[done:], off + done)

    def read(self, path: str) -> Buffer:
        """Read a whole file into page-aligned memory with parallel preadv."""
        size = os.path.getsize(path)
        if size == 0:
            return bytearray()
        # private: faulting in shared anonymous (shmem) pages costs about twice the CPU
        buf = mmap.mmap(-1, -(-size // ALIGN) * ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(buf)
        fd = -1
        if self.direct:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:
                fd = -1
        if fd < 0:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            def read_block(block: tuple[int, int]) -> None:
                off, n = block
                padded = -(-n // ALIGN) * ALIGN
                done = 0
                while done < n:
                    got = os.preadv(fd, [view[off + done:off + padded]], off + done)
                    if got == 0:
                        raise OSError(f"{path}: file shrank while reading")
                    done += got
            list(self._pool.map(read_block, _blocks(size, self.task_size)))
        finally:
            os.close(fd)
        return view[:size]


class KvikioEngine:
    """kvikio ``CuFile`` I/O: GDS when available, compat mode otherwise.

    Args:
        num_threads: kvikio's thread pool size (process-wide kvikio setting).
        task_size: kvikio's task size (process-wide kvikio setting).
    """

    name = "kvikio"

    def __init__(self, num_threads: int = 4, task_size: int = 16 << 20) -> None:
        """Import kvikio and apply the settings; raises if kvikio cannot run here."""
        import kvikio
        import kvikio.defaults

        self._kvikio: Any = kvikio
        kvikio.defaults.set({"num_threads": num_threads, "task_size": task_size})
        try:  # O_DIRECT reads (compat mode) into read()'s page-aligned buffers: no page-cache fill and copy
            kvikio.defaults.set({"auto_direct_io_read": True})
        except Exception:  # a kvikio without the setting reads through the page cache
            pass

    def write(self, path: str, parts: Sequence[Buffer], *, fsync: bool) -> int:
        """Write ``parts`` with parallel ``pwrite`` futures, then fsync."""
        if os.path.exists(path):
            raise FileExistsError(path)
        size = 0
        f = self._kvikio.CuFile(path, "w")
        try:
            futures = []
            for part in parts:
                n = len(part)
                if n:
                    futures.append((f.pwrite(part, n, size), n))
                    size += n
            for future, n in futures:
                if future.get() != n:
                    raise OSError(f"{path}: short write")
        finally:
            f.close()
        if fsync:
            fsync_file(path)
        return size

    def read(self, path: str) -> Buffer:
        """Read a whole file with one parallel ``pread``."""
        size = os.path.getsize(path)
        if size == 0:
            return bytearray()
        # page-aligned and private, not bytearray(size): no zero-fill pass, and O_DIRECT needs no bounce copy
        buf = memoryview(mmap.mmap(-1, -(-size // ALIGN) * ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))[:size]
        f = self._kvikio.CuFile(path, "r")
        try:
            if f.pread(buf, size, 0).get() != size:
                raise OSError(f"{path}: short read")
        finally:
            f.close()
        return buf


def _log_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def select_engine(engine: str = "auto", *, num_threads: int = 4, task_size: int = 16 << 20,
                  direct: bool = True) -> Engine:
    """Return the engine named ``engine``; ``"auto"`` prefers kvikio and falls back to POSIX.

    Raises:
        RuntimeError: ``engine="kvikio"`` and kvikio cannot run here.
        ValueError: an unknown engine name.
    """
    if engine not in ("auto", "kvikio", "posix"):
        raise ValueError(f"unknown engine {engine!r}; use 'auto', 'kvikio' or 'posix'")
    if engine in ("auto", "kvikio"):
        try:
            kv = KvikioEngine(num_threads, task_size)
            _probe(kv)
            return kv
        except Exception as exc:  # ImportError, or RuntimeError: libcuda.so.1 missing
            if engine == "kvikio":
                raise RuntimeError(f"kvikio cannot run here: {exc}") from exc
            _log_once("kvikio", "kvikio unavailable (%s); NVMeTier uses the POSIX engine", exc)
    return PosixEngine(num_threads, task_size, direct)


def _probe(engine: KvikioEngine) -> None:
    """Fail fast if kvikio cannot do I/O (it loads libcuda lazily, on first I/O)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="asym-kvikio-probe-") as d:
        path = os.path.join(d, "probe")
        engine.write(path, [b"\0" * 16], fsync=False)
        if bytes(engine.read(path)) != b"\0" * 16:
            raise RuntimeError("kvikio probe read back wrong bytes")
