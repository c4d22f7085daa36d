"""Blocking file primitives with explicit durability (run them in a thread)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import threading
import time
import uuid
from collections.abc import Sequence

import xxhash

from asymstore.errors import CorruptVersionError
from asymstore.format.names import QUARANTINE

_IOV_MAX = 1024
_DIRECT_MIN_BYTES = 8 << 20  # durable files at least this large bypass the page cache
_DIRECT_CHUNK = 16 << 20  # bytes per O_DIRECT write: one aligned bounce buffer per thread
_DIRECT_ALIGN = 4096  # file offset, length and memory alignment used for O_DIRECT
_DIRECT_MAX_WRITE = 256 << 20  # most bytes per write() straight from the caller's memory
_bounce = threading.local()


def write_parts(path: str, parts: Sequence[memoryview | bytes | bytearray], *, fsync: bool = True) -> int:
    """Create ``path`` (it must not exist) holding ``parts`` concatenated; return its size.

    Uses ``writev`` so many small buffers become few system calls, and fsyncs
    the file before returning when ``fsync`` is true.

    A durable file (``fsync``) of at least 8 MiB is written with O_DIRECT
    where the filesystem allows it, through an aligned bounce buffer: the
    bytes go from that buffer to the disk without filling the page cache,
    whose page allocation and copy cost more than the disk write on a busy
    or virtualised host. The unaligned tail, small files and filesystems
    without O_DIRECT use ``writev``. The fsync is the same either way.
    """
    pending = [memoryview(p).cast("B") for p in parts if len(p)]
    total = sum(len(p) for p in pending)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        if fsync and total >= _DIRECT_MIN_BYTES and _set_direct(fd, True):
            try:
                pending = _write_direct(fd, pending)
            finally:
                _set_direct(fd, False)
        _writev_all(fd, pending)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return total


def _writev_all(fd: int, pending: list[memoryview]) -> None:
    """Write every buffer of ``pending`` at the file position, in order."""
    while pending:
        batch = pending[:_IOV_MAX]
        written = os.writev(fd, batch)
        # drop fully written buffers, trim a partially written one
        consumed = 0
        while consumed < len(batch) and written >= len(batch[consumed]):
            written -= len(batch[consumed])
            consumed += 1
        pending = pending[consumed:]
        if written:
            pending[0] = pending[0][written:]


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False when the filesystem does not support it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as exc:
        if on and exc.errno == errno.EINVAL:
            return False
        raise
    return True


def address_of(view: memoryview) -> int | None:
    """The memory address of a writable contiguous buffer; None for a read-only one (bytes)."""
    if view.readonly or not view.c_contiguous:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _write_direct(fd: int, pending: list[memoryview]) -> list[memoryview]:
    """Write the aligned prefix of ``pending`` with O_DIRECT; return what is left to write.

    A buffer that starts on a page boundary, at an aligned file position, is
    written from its own memory (its whole pages; the tail goes on); other
    bytes are gathered into this thread's bounce buffer and written in whole
    aligned blocks. What remains (the unaligned tail, or everything from the
    first short or refused write on) is returned for ``writev``.
    """
    buf: mmap.mmap | None = getattr(_bounce, "buf", None)
    if buf is None:
        # page aligned; private, so a forked child never shares it with its parent
        buf = _bounce.buf = mmap.mmap(-1, _DIRECT_CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    bounce = memoryview(buf)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    filled = 0
    i = 0

    def write(view: memoryview) -> int:
        try:
            return os.write(fd, view)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return 0  # the filesystem took the flag but not this alignment

    while i < len(pending):
        part = pending[i]
        if filled % _DIRECT_ALIGN == 0 and len(part) >= _DIRECT_ALIGN:
            address = address_of(part)
            if address is not None and address % _DIRECT_ALIGN == 0:
                if filled:  # the gathered bytes end on a block boundary: out first, then the part in place
                    if write(bounce[:filled]) < filled:
                        return [memoryview(bytes(bounce[:filled])), *pending[i:]]
                    filled = 0
                whole = len(part) - len(part) % _DIRECT_ALIGN
                done = 0
                while done < whole:
                    n = write(part[done:min(whole, done + _DIRECT_MAX_WRITE)])
                    if n <= 0 or n % _DIRECT_ALIGN:
                        return [part[done:], *pending[i + 1:]] if n <= 0 else [part[done + n:], *pending[i + 1:]]
                    done += n
                if whole == len(part):
                    i += 1
                else:
                    pending[i] = part[whole:]
                continue
        n = min(len(part), _DIRECT_CHUNK - filled)
        address = address_of(part)
        if address is not None:  # memmove releases the GIL (a slice assignment holds it): threads copy at once
            ctypes.memmove(base + filled, address, n)
        else:
            bounce[filled:filled + n] = part[:n]
        filled += n
        if n == len(part):
            i += 1
        else:
            pending[i] = part[n:]
        if filled == _DIRECT_CHUNK or i == len(pending):
            size = filled if filled == _DIRECT_CHUNK else filled // _DIRECT_ALIGN * _DIRECT_ALIGN
            written = write(bounce[:size]) if size else 0
            if written < filled:
                # copy out of the bounce buffer: a later call on this thread reuses it
                return [memoryview(bytes(bounce[written:filled])), *pending[i:]]
            filled = 0
    return []


def open_regular(path: str, *, expected_size: int | None = None, max_size: int | None = None) -> tuple[int, int]:
    """Open ``path`` read-only and check, on that descriptor, that it is a plain file of an acceptable size.

    Opened without following a symlink and without blocking (a FIFO or a
    device never hangs the caller); nothing is read. The caller closes the
    descriptor.

    Returns:
        ``(fd, size)``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptVersionError: it is a symlink, not a regular file, or its size is not the one expected.
        OSError: it cannot be opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptVersionError(f"{path} is a symlink; only regular files are read") from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptVersionError(f"{path} is not a regular file")
        if expected_size is not None and info.st_size != expected_size:
            raise CorruptVersionError(f"{path} has {info.st_size} bytes, the manifest says {expected_size}")
        if max_size is not None and info.st_size > max_size:
            raise CorruptVersionError(f"{path} has {info.st_size} bytes, more than the {max_size} accepted")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def check_regular(path: str, *, expected_size: int | None = None, max_size: int | None = None) -> int:
    """Return the size of ``path`` after checking it is a plain file of an acceptable size (:func:`open_regular`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptVersionError: it is a symlink, not a regular file, or its size is not the one expected.
    """
    fd, size = open_regular(path, expected_size=expected_size, max_size=max_size)
    os.close(fd)
    return size


def read_regular(path: str, *, max_size: int) -> bytearray:
    """Read a small untrusted file: opened once (:func:`open_regular`), at most ``max_size`` bytes read from that fd.

    The checks and the read are on the same descriptor, so a file swapped for
    a symlink or a larger one after the check is never read; a file that grew
    past ``max_size`` meanwhile is refused after reading ``max_size + 1`` bytes.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptVersionError: a symlink, not a regular file, or larger than ``max_size``.
        OSError: it cannot be opened or read.
    """
    fd, size = open_regular(path, max_size=max_size)
    try:
        data = _read_fd(fd, size + 1)  # one byte past the size seen: a file that grew since the fstat shows
        if len(data) > size:  # read on, never past the cap
            data += _read_fd(fd, max_size + 1 - len(data))
    finally:
        os.close(fd)
    if len(data) > max_size:
        raise CorruptVersionError(f"{path} has more than the {max_size} bytes accepted")
    return data


def check_directory(path: str) -> None:
    """Raise CorruptVersionError unless ``path`` is a real directory (not a symlink to one)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise
    if not stat.S_ISDIR(mode):
        raise CorruptVersionError(f"{path} is not a directory (symlinks are never followed out of the root)")


def read_whole(path: str) -> bytearray:
    """Read all of ``path`` into a new bytearray."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _read_fd(fd: int, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    done = 0
    while done < size:
        n = os.readv(fd, [view[done:]])
        if n == 0:
            break
        done += n
    if done != size:
        del view
        del buf[done:]
    return buf


def read_large(path: str) -> memoryview | bytearray:
    """Read all of ``path``; a file of 8 MiB or more bypasses the page cache.

    Such a file is read with O_DIRECT into a private, page-aligned anonymous
    mapping, returned as a writable memoryview of the file's bytes: the disk
    fills that memory directly, with no page-cache fill, no copy and no
    zeroing (on a busy or virtualised host those cost more than the disk
    read). Smaller files, and filesystems without O_DIRECT, are read as by
    :func:`read_whole`.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < _DIRECT_MIN_BYTES or not _set_direct(fd, True):
            return _read_fd(fd, size)
        aligned = -(-size // _DIRECT_ALIGN) * _DIRECT_ALIGN
        view = memoryview(mmap.mmap(-1, aligned, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        done = 0
        direct = True
        while done < size:
            try:
                # direct: aligned offset, length and address; the read stops short at the end of file
                n = os.preadv(fd, [view[done:] if direct else view[done:size]], done)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                direct = not _set_direct(fd, False)  # the filesystem took the flag but not this read
                continue
            if n == 0:
                break
            done += n
            if direct and done % _DIRECT_ALIGN and done < size:
                direct = not _set_direct(fd, False)  # a short read left the offset unaligned
        return view[:min(done, size)]
    finally:
        os.close(fd)


_HASH_PIECE = 1 << 20  # bytes filled then hashed at once, while they are still in the cache


def read_ranges(path: str, size: int, ranges: Sequence[tuple[int, memoryview]], *,
                hashes: bool = False, direct: bool = True) -> list[str] | None:
    """Fill each ``(offset, view)`` of ``ranges`` with bytes ``[offset, offset + len(view))`` of ``path``.

    ``path`` must be a regular file of ``size`` bytes (checked on the open
    descriptor, never following a symlink). With ``direct``, a file of 8 MiB
    or more is read with O_DIRECT in aligned windows through this thread's
    reused bounce buffer, each window copied once into the views it overlaps:
    no page-cache fill and no fresh memory per read. Otherwise (small files,
    ``direct`` off, or where O_DIRECT is refused) each range is read with
    ``preadv`` straight into its view: on a file that is already memory
    (tmpfs), that is the one copy, done by the kernel without the GIL, so
    several segments read at once use several cores.

    With ``hashes``, each range's xxh3-64 digest is computed as it is filled,
    1 MiB at a time while those bytes are still in the cache, and the digests
    are returned in the order of ``ranges`` (no second pass over cold memory).

    Raises:
        CorruptVersionError: not a regular file, another size, or a range past the end.
        OSError: the read failed.
    """
    states = [xxhash.xxh3_64() for _ in ranges] if hashes else None
    order = sorted(((off, view.cast("B") if view.format != "B" else view, i) for i, (off, view) in enumerate(ranges)
                    if len(view)), key=lambda r: r[0])
    if any(off + len(view) > size for off, view, _ in order):
        raise CorruptVersionError(f"{path}: a range runs past the end of its {size} bytes")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise CorruptVersionError(f"{path} is not a regular file of {size} bytes")
        if direct and size >= _DIRECT_MIN_BYTES and order and _set_direct(fd, True):
            order = _read_ranges_direct(fd, size, order, states)
            _set_direct(fd, False)
        for off, view, i in order:
            _pread_all(fd, view, off, path, None if states is None else states[i])
    finally:
        os.close(fd)
    return None if states is None else [s.hexdigest() for s in states]


def _pread_all(fd: int, view: memoryview, offset: int, path: str, state: xxhash.xxh3_64 | None) -> None:
    done = 0
    step = _HASH_PIECE if state is not None else len(view)
    while done < len(view):
        piece = view[done:done + step]
        n = os.preadv(fd, [piece], offset + done)
        if n == 0:
            raise CorruptVersionError(f"{path}: short read at {offset + done}")
        if state is not None:
            state.update(piece[:n])
        done += n


def _read_ranges_direct(fd: int, size: int, order: list[tuple[int, memoryview, int]],
                        states: list[xxhash.xxh3_64] | None) -> list[tuple[int, memoryview, int]]:
    """Read the ranges (sorted) through aligned O_DIRECT windows; return what is left for buffered reads."""
    buf: mmap.mmap | None = getattr(_bounce, "buf", None)
    if buf is None:
        buf = _bounce.buf = mmap.mmap(-1, _DIRECT_CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    bounce = memoryview(buf)
    i = 0
    pending = list(order)
    while i < len(pending):
        start = pending[i][0] // _DIRECT_ALIGN * _DIRECT_ALIGN
        limit = start + _DIRECT_CHUNK
        need = start  # the window reaches only as far as the ranges that start in it: a few KiB wanted out of
        j = i         # a large segment must not cost a whole 16 MiB read
        while j < len(pending) and pending[j][0] < limit:
            need = max(need, pending[j][0] + len(pending[j][1]))
            j += 1
        want = min(-(-min(need, limit, size) // _DIRECT_ALIGN) * _DIRECT_ALIGN, limit) - start
        try:
            got = os.preadv(fd, [bounce[:want]], start)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return pending[i:]  # the filesystem took the flag but not this read
        end = start + got
        if got == 0:
            return pending[i:]
        while i < len(pending) and pending[i][0] < end:
            off, view, index = pending[i]
            n = min(len(view), end - off)
            state = None if states is None else states[index]
            for at in range(0, n, _HASH_PIECE if state is not None else max(n, 1)):
                stop = min(n, at + (_HASH_PIECE if state is not None else n))
                view[at:stop] = bounce[off - start + at:off - start + stop]
                if state is not None:
                    state.update(view[at:stop])
            if n < len(view):
                pending[i] = (off + n, view[n:], index)
                break
            i += 1
    return []


_IN_FLIGHT: set[str] = set()  # the temporary files atomic_write is writing in this process (absolute paths)


def in_flight(path: str) -> bool:
    """Whether ``path`` is a temporary file :func:`atomic_write` is writing in this process (a sweep skips it)."""
    return os.path.abspath(path) in _IN_FLIGHT


def atomic_write(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically: tmp file, fsync, rename, fsync dir.

    The temporary file (``.NAME.<id>.tmp`` beside ``path``) is known to :func:`in_flight` while it
    exists, so a sweep of the directory by this process (another thread's) leaves it alone.
    """
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    key = os.path.abspath(tmp)
    _IN_FLIGHT.add(key)
    try:
        write_parts(tmp, [data], fsync=fsync)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        _IN_FLIGHT.discard(key)
    if fsync:
        fsync_dir(directory)


def fsync_file(path: str) -> None:
    """Flush a written file's data and metadata to stable storage (opened again read-only, by path)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (new, renamed, removed names) to stable storage."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def quarantine_entry(root: str, path: str, label: str, *, fsync: bool = True) -> str:
    """Move ``path`` (an entry of the tier ``root``) to ``root/.quarantine/<label>-<time>-<id>``; return where."""
    qdir = os.path.join(root, QUARANTINE)
    os.makedirs(qdir, exist_ok=True)
    dest = os.path.join(qdir, f"{label}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}")
    os.rename(path, dest)
    if fsync:
        fsync_dir(qdir)
        fsync_dir(root)
    return dest
