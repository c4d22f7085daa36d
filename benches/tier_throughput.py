"""Write and read throughput of every storage tier, next to its device's limit measured in the same run.

Run by hand (never a timed test)::

    .venv/bin/python benches/tier_throughput.py --out bench-out/tier_throughput.json
    .venv/bin/python benches/tier_throughput.py --tiers host,nvme-posix --size-mib 2048 --repeat 5 --store

Each tier is measured at the tier level, the way :class:`asymstore.AsymStore`
drives it: ``begin`` -> ``write_segment`` per segment (``--segment-mib``
each, one part, random bytes) -> ``publish`` is the write; the read is
``read_segment`` of every segment, 4 at a time as ``restore`` reads
(``--read-ahead``), buffers kept until the last one arrives. Next to each
measurement, in the same repetition, the same bytes go through the device's
limit:

* ``host`` (HostTier in process memory) and ``gpu`` (GPUTier; on the CPU
  device where there is no CUDA): memcpy of the same segments into a
  preallocated, already touched buffer, both as a memoryview slice
  assignment (what HostTier does) and as ``torch.Tensor.copy_``; the faster
  of the two is the limit. On a CUDA machine the GPU tier's limits are the
  host->device copy of the same segments (write) and the device->host copy
  into preallocated host memory (read); a device->device copy is recorded
  too. The in-memory tiers get one untimed warm-up version first (their
  buffer pool is then reused, as in training); its time is reported as
  ``first write``. The time of a copy into a *fresh* buffer (what a read
  must return: a buffer the caller owns) is recorded as ``fresh_copy``.
* ``nvme-posix``, ``nvme-kvikio`` (NVMeTier with each engine) and ``local``
  (LocalTier): O_DIRECT sequential write of the same number of bytes in
  64 MiB blocks then ``fsync`` and O_DIRECT sequential read of it (the
  Python equivalent of ``dd oflag=direct conv=fsync`` / ``dd iflag=direct``,
  from ``benches/common.py``), in ``--dir``. kvikio needs
  ``libcuda.so.1``: where no real one loads, the test stub
  (``tests/stub_libcuda.c``) is built with gcc into a temporary directory
  and loaded under that soname, so kvikio runs its compat (POSIX) mode;
  the output says which was used.
* ``remote-file`` (RemoteTier on ``file://`` under ``--dir``) and
  ``remote-s3`` (RemoteTier on a moto S3 server started on 127.0.0.1 in a
  child process): a plain pyarrow upload of one object of the same size
  (``open_output_stream`` + one ``write``) and download of it
  (``open_input_file`` + ``readinto`` a preallocated buffer) with the
  tier's own filesystem object. Each is measured with the tier's default
  ``verify="checksum"`` (every upload read back and hashed) and with
  ``verify="size"`` (``--remote-verify``). S3 uses ``--s3-size-mib`` (moto
  is slow).

Cold reads: before every disk or file:// read (the tier's and the limit's)
the files are evicted from the page cache with ``fdatasync`` +
``posix_fadvise(POSIX_FADV_DONTNEED)`` and the fraction still resident is
measured with ``mincore`` and reported. moto keeps objects in its own
process memory: S3 reads are not cold in that sense. Before each timed
write to a disk (tier and limit) ``sync`` runs, untimed, so that neither
is throttled by the other's dirty pages. The process CPU seconds of every
tier write and read are recorded too (less sensitive to other load than
wall time; kvikio's threads included, moto's process not).

``--store`` also measures ``AsymStore.put_many`` + ``commit`` and a
``restore`` (from a freshly opened store, cold, for persistent tiers) with
``compression="never"`` and ``segment_bytes`` = the segment size, tensors
of 16 MiB; its ratios are against the median limits of the same tier.

GB/s are 10**9 bytes per second. Each repetition's ratio is tier / limit
of that repetition; the median over ``--repeat`` repetitions is reported
and every sample is in the JSON. Targets: host tier >= 0.8 of memcpy,
NVMe tier writes >= 0.9 of the O_DIRECT write limit. Outputs: JSON
(``--out``) and a PNG plot next to it (``--plot``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import math
import mmap
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from common import (
    DD_BLOCK,
    MIB,
    REPO,
    Pressure,
    aligned_random_buffer,
    cpu_seconds,
    evict,
    files_under,
    gbps,
    git_state,
    median,
    odirect_read,
    odirect_write,
    pyplot,
    save_figure,
    write_json,
)

from asymstore import AsymStore
from asymstore.format.names import version_dirname
from asymstore.format.tensors import as_bytes
from asymstore.tiers import GPUTier, HostTier, LocalTier, NVMeTier, RemoteTier, Tier
from asymstore.tiers.protocol import Buffer

ALL_TIERS = ("host", "gpu", "nvme-posix", "nvme-kvikio", "local", "remote-file", "remote-s3")
STORE_TENSOR = 16 * MIB
TARGETS = {  # (case key prefix, direction) -> least ratio to the limit
    ("host", "write"): 0.8, ("host", "read"): 0.8,
    ("nvme-posix", "write"): 0.9, ("nvme-kvikio", "write"): 0.9,
}
MANIFEST = b'{"bench": "tier_throughput"}\n'
_TEMP_DIRS: list[str] = []


# -- the bytes ---------------------------------------------------------------


def u8(buf: Buffer | torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over ``buf`` (no copy)."""
    if isinstance(buf, torch.Tensor):
        return buf.view(-1).view(torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: only read here
        return torch.frombuffer(buf, dtype=torch.uint8)


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` random bytes (incompressible), touched, in one tensor."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def segment_name(i: int) -> str:
    """The file name of segment ``i`` (the store's naming)."""
    return f"seg-{i:06d}.bin"


def same(a: Buffer | torch.Tensor, b: Buffer | torch.Tensor) -> bool:
    """Byte equality."""
    ta, tb = u8(a), u8(b)
    return ta.numel() == tb.numel() and bool(torch.equal(ta.cpu(), tb.cpu()))


# -- device limits -------------------------------------------------------------


class Limit:
    """The device's limit for moving the same bytes; each method returns seconds."""

    description = ""

    def write(self, data: memoryview, seg: int) -> float:
        """Seconds to move ``data`` (contiguous; the tier gets it in ``seg``-byte segments) to the device."""
        raise NotImplementedError

    def read(self) -> float:
        """Seconds to move them back (cold where the device has a cache)."""
        raise NotImplementedError

    def extra(self) -> dict[str, float]:
        """Side measurements of the last write/read (seconds), for the JSON."""
        return {}

    def close(self) -> None:
        """Free buffers and files."""


class MemcpyLimit(Limit):
    """memcpy into preallocated, touched host memory: memoryview assignment and ``torch.copy_``, the faster."""

    description = ("memcpy of the same segments into a preallocated touched buffer (faster of memoryview slice "
                   "assignment and torch copy_)")

    def __init__(self, nbytes: int) -> None:
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)  # zeros: every page touched before timing
        self.out = torch.zeros(nbytes, dtype=torch.uint8)
        self.seg = 0
        self._extra: dict[str, float] = {}

    def write(self, data: memoryview, seg: int) -> float:
        """Copy ``data`` into ``dst`` by segment; both primitives are timed, the faster is returned."""
        self.seg = seg
        n = len(data)
        dst, src = as_bytes(self.dst), u8(data)
        t0 = time.perf_counter()
        for pos in range(0, n, seg):
            dst[pos:pos + seg] = data[pos:pos + seg]
        t_view = time.perf_counter() - t0
        t0 = time.perf_counter()
        for pos in range(0, n, seg):
            self.dst[pos:pos + seg].copy_(src[pos:pos + seg])
        t_torch = time.perf_counter() - t0
        self._extra = {"write_memoryview_s": t_view, "write_torch_copy_s": t_torch}
        return min(t_view, t_torch)

    def read(self) -> float:
        """Copy ``dst`` back into ``out`` by segment; also time a copy into fresh buffers (recorded only)."""
        n = self.dst.numel()
        src, out = as_bytes(self.dst), as_bytes(self.out)
        t0 = time.perf_counter()
        for pos in range(0, n, self.seg):
            out[pos:pos + self.seg] = src[pos:pos + self.seg]
        t_view = time.perf_counter() - t0
        t0 = time.perf_counter()
        for pos in range(0, n, self.seg):
            self.out[pos:pos + self.seg].copy_(self.dst[pos:pos + self.seg])
        t_torch = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh = [bytearray(src[pos:pos + self.seg]) for pos in range(0, n, self.seg)]
        t_fresh = time.perf_counter() - t0
        del fresh
        self._extra.update({"read_memoryview_s": t_view, "read_torch_copy_s": t_torch, "fresh_copy_s": t_fresh})
        return min(t_view, t_torch)

    def extra(self) -> dict[str, float]:
        """The time of each primitive, and of a copy into fresh buffers (``bytearray(view)``)."""
        return dict(self._extra)

    def close(self) -> None:
        """Free the buffers."""
        del self.dst, self.out


class CudaLimit(Limit):
    """Host->device copy of the segments (write), device->host into preallocated host memory (read)."""

    description = ("host->device copy of the same segments into preallocated device memory (write); "
                   "device->host into a preallocated pageable host buffer (read); device->device recorded")

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.zeros(nbytes, dtype=torch.uint8)
        self.seg = 0
        self._extra: dict[str, float] = {}

    def write(self, data: memoryview, seg: int) -> float:
        """H2D copy of each segment (pageable source, as the tier gets it), synchronized."""
        self.seg = seg
        src = u8(data)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for pos in range(0, len(data), seg):
            self.dev[pos:pos + seg].copy_(src[pos:pos + seg])
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def read(self) -> float:
        """D2H copy by segment into preallocated host memory; a D2D copy is timed too."""
        n = self.dev.numel()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for pos in range(0, n, self.seg):
            self.host[pos:pos + self.seg].copy_(self.dev[pos:pos + self.seg])
        torch.cuda.synchronize()
        t_d2h = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.dev2.copy_(self.dev)
        torch.cuda.synchronize()
        self._extra = {"device_to_device_s": time.perf_counter() - t0}
        return t_d2h

    def extra(self) -> dict[str, float]:
        """The device->device copy time."""
        return dict(self._extra)

    def close(self) -> None:
        """Free device and host memory."""
        del self.dev, self.dev2, self.host
        torch.cuda.empty_cache()


class DiskLimit(Limit):
    """O_DIRECT sequential write (64 MiB blocks, then fsync) and read of a file of the same size."""

    description = ("O_DIRECT sequential write of the same bytes in 64 MiB blocks + fsync, and O_DIRECT sequential "
                   "read (dd oflag=direct conv=fsync / iflag=direct), same filesystem")

    def __init__(self, directory: str, buf: mmap.mmap) -> None:
        self.path = os.path.join(directory, "dd-limit.bin")
        self.buf = buf
        self.nbytes = 0
        self.resident = 0.0

    def write(self, data: memoryview, seg: int) -> float:
        """dd-like write of ``len(data)`` bytes (random bytes from the dd buffer)."""
        self.nbytes = len(data)
        return odirect_write(self.path, self.nbytes, self.buf)

    def read(self) -> float:
        """dd-like read after evicting the file."""
        self.resident = evict([self.path], "fadvise")
        seconds, got = odirect_read(self.path, self.buf)
        if got != self.nbytes:
            raise OSError(f"dd read {got} of {self.nbytes} bytes")
        return seconds

    def extra(self) -> dict[str, float]:
        """Fraction of the dd file still cached before its read."""
        return {"resident_before_read": self.resident}

    def close(self) -> None:
        """Remove the file."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ArrowLimit(Limit):
    """A plain pyarrow upload and download of one object of the same size, with the tier's filesystem object."""

    description = ("plain pyarrow upload of one object of the same size (open_output_stream + one write) and "
                   "download (open_input_file + readinto a preallocated buffer), with the tier's filesystem object")

    def __init__(self, fs: Any, path: str, local_path: str | None) -> None:
        self.fs = fs
        self.path = path
        self.local_path = local_path  # file://: the file on disk, evicted before the read
        self.out = bytearray()
        self.resident = math.nan

    def write(self, data: memoryview, seg: int) -> float:
        """Upload ``data`` as one object (one write of the whole buffer)."""
        nbytes = len(data)
        if len(self.out) != nbytes:
            self.out = bytearray(nbytes)
            u8(self.out).fill_(1)  # touch every page before timing
        t0 = time.perf_counter()
        with self.fs.open_output_stream(self.path) as f:
            f.write(data)
        seconds = time.perf_counter() - t0
        if self.local_path:  # untimed: its dirty pages would otherwise throttle the tier's writes that follow
            fd = os.open(self.local_path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        return seconds

    def read(self) -> float:
        """Download the object into the preallocated buffer."""
        if self.local_path:
            self.resident = evict([self.local_path], "fadvise")
        view = memoryview(self.out)
        t0 = time.perf_counter()
        with self.fs.open_input_file(self.path) as f:
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise OSError(f"{self.path}: short read")
                done += n
        return time.perf_counter() - t0

    def extra(self) -> dict[str, float]:
        """Fraction of the file still cached before its read (file:// only)."""
        return {} if math.isnan(self.resident) else {"resident_before_read": self.resident}

    def close(self) -> None:
        """Delete the object and free the buffer."""
        with contextlib.suppress(OSError):
            self.fs.delete_file(self.path)
        self.out = bytearray()


# -- kvikio's libcuda and a moto S3 server ---------------------------------------


def ensure_libcuda() -> str:
    """Make ``libcuda.so.1`` loadable for kvikio: the real driver, else the test stub built with gcc."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return "real libcuda.so.1"
    except OSError:
        pass
    if shutil.which("gcc") is None:
        raise RuntimeError("no libcuda.so.1 and no gcc to build tests/stub_libcuda.c")
    out = os.path.join(tempfile.mkdtemp(prefix="asym-stubcuda-"), "libcuda.so.1")
    _TEMP_DIRS.append(os.path.dirname(out))  # removed at exit; the loaded library stays mapped
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", out,
                    str(REPO / "tests" / "stub_libcuda.c")], check=True)
    ctypes.CDLL(out, mode=ctypes.RTLD_GLOBAL)
    return f"stub libcuda.so.1 built from tests/stub_libcuda.c at {out} (kvikio compat mode, POSIX I/O)"


def kvikio_settings() -> dict[str, Any]:
    """kvikio's version and I/O settings, as it runs in this process."""
    import kvikio
    import kvikio.defaults

    out: dict[str, Any] = {"version": kvikio.__version__}
    for key in ("compat_mode", "num_threads", "task_size", "auto_direct_io_read", "auto_direct_io_write",
                "bounce_buffer_size"):
        with contextlib.suppress(Exception):
            value = kvikio.defaults.get(key)
            out[key] = getattr(value, "name", value)  # enums by name (compat_mode: ON, OFF, AUTO)
    with contextlib.suppress(Exception):
        out["compat_mode_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    return out


@dataclass
class MotoServer:
    """A moto S3 server in a child process on 127.0.0.1, with one bucket."""

    proc: subprocess.Popen[bytes]
    port: int
    bucket: str = "asymstore-bench"

    def uri(self, prefix: str) -> str:
        """An ``s3://`` URI under the bucket with the endpoint and test credentials."""
        return (f"s3://{self.bucket}/{prefix}?endpoint_override=127.0.0.1:{self.port}&scheme=http"
                "&access_key=test&secret_key=test&region=us-east-1")

    def stop(self) -> None:
        """Terminate the server process."""
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def moto_server() -> Iterator[MotoServer]:
    """Start ``python -m moto.server`` on a free loopback port and create the bucket."""
    import pyarrow.fs as pafs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = MotoServer(proc, port)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="test",
                               secret_key="test", region="us-east-1", allow_bucket_creation=True)
        fs.create_dir(server.bucket)
        yield server
    finally:
        server.stop()


# -- the cases -----------------------------------------------------------------


@dataclass
class Case:
    """One tier configuration and the limit it is compared with."""

    key: str
    label: str
    nbytes: int
    make: Callable[[], Tier]
    make_limit: Callable[[Tier], Limit]
    cold_files: Callable[[Tier, int], list[str]] | None = None  # files to evict before a read
    warm_up: bool = False  # one untimed version first (in-memory tiers: fills the buffer pool)
    notes: list[str] = field(default_factory=list)


def version_files(tier: Tier, step: int) -> list[str]:
    """The files of version ``step`` of a directory tier (LocalTier, NVMeTier)."""
    assert isinstance(tier, LocalTier)
    return files_under(os.path.join(tier.root, version_dirname(step)))


def remote_file_files(tier: Tier, step: int) -> list[str]:
    """The files of version ``step`` of a ``file://`` RemoteTier."""
    assert isinstance(tier, RemoteTier)
    return files_under(os.path.join(tier.root, version_dirname(step)))


def build_cases(args: argparse.Namespace, dd_buf: mmap.mmap, env: dict[str, Any],
                s3: MotoServer | None) -> list[Case]:
    """The cases selected by ``--tiers``, in order."""
    nbytes = args.size_mib * MIB
    s3_bytes = args.s3_size_mib * MIB
    cases: list[Case] = []
    mem_cap = nbytes + 64 * MIB
    cuda = torch.cuda.is_available()

    def disk_limit(case_dir: str) -> Callable[[Tier], Limit]:
        return lambda _tier: DiskLimit(case_dir, dd_buf)

    for key in args.tiers:
        case_dir = os.path.join(args.dir, key)
        if key == "host":
            cases.append(Case(key, "HostTier (process memory)", nbytes, lambda: HostTier(mem_cap),
                              lambda _t: MemcpyLimit(nbytes), warm_up=True))
        elif key == "gpu":
            label = "GPUTier (cuda)" if cuda else "GPUTier (no CUDA: cpu device)"

            def gpu_limit(_t: Tier) -> Limit:
                return CudaLimit(nbytes, torch.device("cuda")) if cuda else MemcpyLimit(nbytes)
            cases.append(Case(key, label, nbytes, lambda: GPUTier(mem_cap), gpu_limit, warm_up=True))
        elif key in ("nvme-posix", "nvme-kvikio", "local"):
            notes = []
            if key == "nvme-kvikio":
                try:
                    env["libcuda"] = ensure_libcuda()
                    import kvikio  # noqa: F401  (fails early when kvikio is not installed)
                except Exception as exc:  # no kvikio, no gcc: the case is skipped, with the reason
                    env["skipped"][key] = f"{type(exc).__name__}: {exc}"
                    print(f"skipping {key}: {exc}", flush=True)
                    continue
                notes.append(env["libcuda"])
            engine = "" if key == "local" else key.split("-")[1]

            def make(root: str = case_dir, engine: str = engine) -> Tier:
                path = os.path.join(root, "tier")
                return NVMeTier(path, engine=engine) if engine else LocalTier(path)
            label = f"NVMeTier ({engine} engine)" if engine else "LocalTier"
            cases.append(Case(key, label, nbytes, make, disk_limit(case_dir), cold_files=version_files,
                              notes=notes))
        elif key in ("remote-file", "remote-s3"):
            for verify in args.remote_verify:
                suffix = "" if verify == "checksum" else f"-{verify}"  # no brackets: URIs are parsed
                if key == "remote-file":
                    root = os.path.abspath(os.path.join(case_dir + suffix, "tier"))

                    def make_file(root: str = root, verify: str = verify) -> Tier:
                        return RemoteTier(f"file://{root}", verify=verify)

                    def file_limit(tier: Tier, root: str = root) -> Limit:
                        assert isinstance(tier, RemoteTier)
                        path = os.path.join(os.path.dirname(root), "limit.bin")
                        return ArrowLimit(tier.fs, path, path)
                    cases.append(Case(key + suffix, f"RemoteTier file:// (verify={verify})", nbytes, make_file,
                                      file_limit, cold_files=remote_file_files))
                else:
                    assert s3 is not None
                    uri = s3.uri(f"bench-{uuid.uuid4().hex[:8]}")

                    def make_s3(uri: str = uri, verify: str = verify) -> Tier:
                        return RemoteTier(uri, verify=verify)

                    def s3_limit(tier: Tier) -> Limit:
                        assert isinstance(tier, RemoteTier)
                        return ArrowLimit(tier.fs, f"{tier.root}-limit.bin", None)
                    cases.append(Case(key + suffix, f"RemoteTier S3/moto (verify={verify})", s3_bytes, make_s3,
                                      s3_limit, notes=["moto keeps objects in its process memory: reads are "
                                                       "not cold"]))
    return cases


# -- one case ------------------------------------------------------------------


async def tier_write(tier: Tier, step: int, segments: Sequence[memoryview]) -> dict[str, float]:
    """begin -> write_segment each -> publish; the time of each phase."""
    nbytes = sum(len(s) for s in segments)
    t0 = time.perf_counter()
    writer = await tier.begin(step, nbytes)
    t1 = time.perf_counter()
    for i, seg in enumerate(segments):
        await writer.write_segment(segment_name(i), [seg])
    t2 = time.perf_counter()
    await writer.publish(MANIFEST)
    t3 = time.perf_counter()
    return {"write_s": t3 - t0, "begin_s": t1 - t0, "segments_s": t2 - t1, "publish_s": t3 - t2}


async def tier_read(tier: Tier, step: int, count: int, read_ahead: int) -> tuple[float, list[Buffer]]:
    """read_segment of every segment, ``read_ahead`` at a time; (seconds, buffers)."""
    sem = asyncio.Semaphore(read_ahead)

    async def one(i: int) -> Buffer:
        async with sem:
            return await tier.read_segment(step, segment_name(i))
    t0 = time.perf_counter()
    bufs = await asyncio.gather(*(one(i) for i in range(count)))
    return time.perf_counter() - t0, list(bufs)


async def settle() -> None:
    """Free what the last read returned before anything else is timed.

    gather's finished tasks keep their results until the event loop runs their done callbacks;
    without a few loop turns here, the next timed write would start by unmapping the 1 GiB just read.
    """
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()


async def run_case(case: Case, source: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Every repetition of one case; its JSON record."""
    seg = args.segment_mib * MIB
    data = as_bytes(source)
    segments = [data[pos:pos + seg] for pos in range(0, case.nbytes, seg)]
    tier = case.make()
    await tier.open()
    limit = case.make_limit(tier)
    record: dict[str, Any] = {"key": case.key, "label": case.label, "tier": repr(tier), "bytes": case.nbytes,
                              "segments": len(segments), "segment_bytes": seg, "limit": limit.description,
                              "cold_read": "fdatasync + posix_fadvise(DONTNEED), mincore checked"
                              if case.cold_files else "n/a (no page cache in the path)",
                              "notes": case.notes}
    if isinstance(tier, NVMeTier):
        record["engine"] = tier.engine.name
        if tier.engine.name == "kvikio":
            record["kvikio"] = kvikio_settings()
    print(f"\n== {case.key}: {case.label}, {case.nbytes / MIB:.0f} MiB in {len(segments)} segments; {tier!r}",
          flush=True)
    step = 1
    reps: list[dict[str, Any]] = []
    try:
        if case.warm_up:
            first = await tier_write(tier, step, segments)
            record["first_write_gbps"] = gbps(case.nbytes, first["write_s"])
            await tier.delete_version(step)
            step += 1
            print(f"  warm-up (first write, buffer pool allocated): {record['first_write_gbps']:.2f} GB/s",
                  flush=True)
        for rep in range(args.repeat):
            rec: dict[str, Any] = {"rep": rep}
            gc.collect()
            if case.cold_files:
                os.sync()  # untimed: start each write with no dirty pages (buffered writes are throttled by them)
            rec["limit_write_s"] = limit.write(data[:case.nbytes], seg)
            if case.cold_files:
                os.sync()
            c0 = cpu_seconds()
            with Pressure() as psi:
                rec.update(await tier_write(tier, step, segments))
            rec["write_cpu_s"] = cpu_seconds() - c0
            rec["write_psi_some"] = psi.share
            rec["limit_read_s"] = limit.read()
            rec.update({f"limit_{k}": v for k, v in limit.extra().items()})
            if case.cold_files:
                rec["resident_before_read"] = evict(case.cold_files(tier, step), "fadvise")
            c0 = cpu_seconds()
            with Pressure() as psi:
                rec["read_s"], bufs = await tier_read(tier, step, len(segments), args.read_ahead)
            rec["read_cpu_s"] = cpu_seconds() - c0
            rec["read_psi_some"] = psi.share
            if rep == 0 or args.verify_all:
                bad = [i for i, (b, s) in enumerate(zip(bufs, segments, strict=True)) if not same(b, s)]
                if bad:
                    raise SystemExit(f"{case.key}: segments {bad} read back differently")
                rec["verified"] = True
            del bufs
            await settle()
            await tier.delete_version(step)
            step += 1
            rec["loadavg_1m"] = os.getloadavg()[0]
            for d in ("write", "read"):
                rec[f"{d}_gbps"] = gbps(case.nbytes, rec[f"{d}_s"])
                rec[f"limit_{d}_gbps"] = gbps(case.nbytes, rec[f"limit_{d}_s"])
                rec[f"{d}_ratio"] = rec[f"{d}_gbps"] / rec[f"limit_{d}_gbps"]
            if "limit_fresh_copy_s" in rec:  # what a read must at least do here: fill fresh memory the caller owns
                rec["read_vs_fresh_copy"] = rec["limit_fresh_copy_s"] / rec["read_s"]
            reps.append(rec)
            print(f"  rep {rep}: write {rec['write_gbps']:.2f} GB/s vs limit {rec['limit_write_gbps']:.2f} "
                  f"({rec['write_ratio']:.2f}) | read {rec['read_gbps']:.2f} vs {rec['limit_read_gbps']:.2f} "
                  f"({rec['read_ratio']:.2f}) | cpu pressure w {rec['write_psi_some'].get('cpu', math.nan):.0%} "
                  f"r {rec['read_psi_some'].get('cpu', math.nan):.0%}, load {rec['loadavg_1m']:.1f}", flush=True)
    finally:
        limit.close()
        await tier.close()
    record["reps"] = reps
    keys = sorted({k for r in reps for k, v in r.items() if isinstance(v, float)})
    record["median"] = {k: median([r[k] for r in reps if k in r]) for k in keys}
    for d in ("write", "read"):
        shares = [r[f"{d}_psi_some"]["cpu"] for r in reps if "cpu" in r[f"{d}_psi_some"]]
        record["median"][f"{d}_psi_cpu"] = median(shares)
    return record


async def store_roundtrip(case: Case, source: torch.Tensor, args: argparse.Namespace,
                          limits: dict[str, float]) -> dict[str, Any]:
    """put_many + commit, then restore, through AsymStore (compression never); medians and ratios."""
    seg = args.segment_mib * MIB
    n = case.nbytes
    tensors = {f"layer.{i}.weight": source[pos:pos + min(STORE_TENSOR, n - pos)]
               for i, pos in enumerate(range(0, n, STORE_TENSOR))}
    opts: dict[str, Any] = {"keep_last": None, "segment_bytes": seg, "compression": "never",
                            "calibration_cache": False}
    reps = []
    for rep in range(args.repeat):
        step = 100 + rep
        gc.collect()
        tier = case.make()
        store = await AsymStore([tier], **opts).open()
        try:
            t0 = time.perf_counter()
            await store.put_many(step, tensors)
            t1 = time.perf_counter()
            await store.commit(step)
            t2 = time.perf_counter()
            resident = math.nan
            if tier.persistent:
                await store.close()
                if case.cold_files:
                    resident = evict(case.cold_files(tier, step), "fadvise")
                store = await AsymStore([case.make()], **opts).open()
            t3 = time.perf_counter()
            ckpt = await store.restore(step)
            t4 = time.perf_counter()
            if rep == 0 and not all(same(ckpt.tensors[k], v) for k, v in tensors.items()):
                raise SystemExit(f"{case.key}: store restore is not bit-exact")
            del ckpt
            await settle()
            for tier_ in store.tiers:
                await tier_.delete_version(step)
        finally:
            await store.close()
        rec = {"put_s": t1 - t0, "commit_s": t2 - t1, "restore_s": t4 - t3, "resident_before_restore": resident,
               "commit_gbps": gbps(n, t2 - t0), "restore_gbps": gbps(n, t4 - t3)}
        reps.append(rec)
        print(f"  store rep {rep}: put_many+commit {rec['commit_gbps']:.2f} GB/s (put {rec['put_s']:.2f} s), "
              f"restore {rec['restore_gbps']:.2f} GB/s", flush=True)
    med = {k: median([r[k] for r in reps]) for k in reps[0]}
    med["commit_ratio"] = med["commit_gbps"] / limits["limit_write_gbps"]
    med["restore_ratio"] = med["restore_gbps"] / limits["limit_read_gbps"]
    return {"options": {k: v for k, v in opts.items()}, "tensor_bytes": STORE_TENSOR, "median": med, "reps": reps}


# -- output --------------------------------------------------------------------


def target_of(key: str, direction: str) -> float | None:
    """The target ratio for a case and direction, if any."""
    return TARGETS.get((key, direction))


def verdicts(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per target: case, direction, ratio, target, met."""
    out = []
    for res in results:
        for d in ("write", "read"):
            target = target_of(res["key"], d)
            if target is not None:
                ratio = res["median"][f"{d}_ratio"]
                out.append({"case": res["key"], "direction": d, "ratio": ratio, "target": target,
                            "met": bool(ratio >= target)})
    return out


def print_table(results: Sequence[dict[str, Any]]) -> None:
    """The summary table (medians over repetitions)."""
    print("\nmedians over repetitions; GB/s = 10^9 B/s; ratio = tier / limit of the same repetition; cpuPSI = share"
          " of wall time some task waited for a CPU (other load)")
    head = (f"{'tier':<34} {'MiB':>5} {'write':>6} {'limW':>6} {'w/lim':>6} {'read':>6} {'limR':>6} {'r/lim':>6} "
            f"{'1stW':>6} {'segW s':>6} {'publ s':>6} {'cpuPSI':>6}")
    print(head)
    for res in results:
        m = res["median"]
        first = res.get("first_write_gbps", math.nan)
        print(f"{res['label']:<34} {res['bytes'] / MIB:>5.0f} {m['write_gbps']:>6.2f} {m['limit_write_gbps']:>6.2f} "
              f"{m['write_ratio']:>6.2f} {m['read_gbps']:>6.2f} {m['limit_read_gbps']:>6.2f} {m['read_ratio']:>6.2f} "
              f"{first:>6.2f} {m['segments_s']:>6.2f} {m['publish_s']:>6.2f} {m['write_psi_cpu']:>6.0%}")
        if "limit_fresh_copy_s" in m:
            print(f"{'':<34}       copy into fresh buffers (alloc + page faults + copy): "
                  f"{gbps(res['bytes'], m['limit_fresh_copy_s']):.2f} GB/s; read / that: "
                  f"{m['read_vs_fresh_copy']:.2f}")
        print(f"{'':<34}       process CPU s: write {m['write_cpu_s']:.2f}, read {m['read_cpu_s']:.2f}")
        if "store" in res:
            s = res["store"]["median"]
            print(f"{'  via AsymStore (never compress)':<34} {'':>5} {s['commit_gbps']:>6.2f} {'':>6} "
                  f"{s['commit_ratio']:>6.2f} {s['restore_gbps']:>6.2f} {'':>6} {s['restore_ratio']:>6.2f}")
    print("\ntargets:")
    for v in verdicts(results):
        verdict = "met" if v["met"] else "NOT met"
        print(f"  {v['case']:<12} {v['direction']:<5} {v['ratio']:.2f} >= {v['target']}: {verdict}")


def plot(results: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Three panels: write GB/s vs limit, read GB/s vs limit (log scale), and the ratios with the targets."""
    plt = pyplot()
    from matplotlib import ticker

    labels = [r["key"] for r in results]
    x = list(range(len(results)))
    w = 0.38
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 1.3 * len(results) + 2), 11), dpi=120)
    for ax, d, color in ((axes[0], "write", "tab:blue"), (axes[1], "read", "tab:orange")):
        tier = [r["median"][f"{d}_gbps"] for r in results]
        lim = [r["median"][f"limit_{d}_gbps"] for r in results]
        lo = [m - min(x_[f"{d}_gbps"] for x_ in r["reps"]) for m, r in zip(tier, results, strict=True)]
        hi = [max(x_[f"{d}_gbps"] for x_ in r["reps"]) - m for m, r in zip(tier, results, strict=True)]
        ax.bar([i - w / 2 for i in x], tier, w, yerr=[lo, hi], capsize=3, color=color,
               label=f"tier {d} (bars: min-max of repeats; label: median ratio to the limit)")
        ax.bar([i + w / 2 for i in x], lim, w, color="lightgray", edgecolor="gray", hatch="//",
               label=f"device limit ({d})")
        for i, r in enumerate(results):  # the ratio above the bar and its error bar, the value inside
            ax.annotate(f"{r['median'][f'{d}_ratio']:.2f}x", (i - w / 2, tier[i] + hi[i]), textcoords="offset points",
                        xytext=(0, 3), ha="center", fontsize=8, fontweight="bold")
            ax.annotate(f"{lim[i]:.2f}", (i + w / 2, lim[i]), textcoords="offset points", xytext=(0, 3),
                        ha="center", fontsize=7, color="dimgray")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        top = max(max(t + h for t, h in zip(tier, hi, strict=True)), max(lim))
        ax.set_ylim(top=top * 4)  # room for the labels and the legend
        ax.set_ylabel(f"{d} GB/s (log)")
        ax.set_xticks(x, labels, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper right")
    ax = axes[2]
    for off, d, color in ((-w / 2, "write", "tab:blue"), (w / 2, "read", "tab:orange")):
        ax.bar([i + off for i in x], [r["median"][f"{d}_ratio"] for r in results], w, color=color,
               label=f"{d} / limit")
        for i, r in enumerate(results):
            target = target_of(r["key"], d)
            if target is not None:
                ax.hlines(target, i + off - w / 2, i + off + w / 2, colors="red", linewidth=2)
    ax.plot([], [], color="red", linewidth=2, label="target")
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_ylabel("tier / limit (median of repeats)")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylim(0, max(1.2, max(max(r["median"]["write_ratio"], r["median"]["read_ratio"]) for r in results) * 1.1))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def read_text(path: str) -> str:
    """A small system file's content, or '' when unreadable."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def parse_tiers(text: str) -> list[str]:
    """'host,nvme-posix' -> the tier keys, checked."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = set(keys) - set(ALL_TIERS)
    if unknown or not keys:
        raise argparse.ArgumentTypeError(f"tiers are among {','.join(ALL_TIERS)}")
    return keys


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tiers", type=parse_tiers, default=list(ALL_TIERS),
                        help=f"comma-separated, among {','.join(ALL_TIERS)} (default: all)")
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes per version, memory/disk tiers (1024)")
    parser.add_argument("--s3-size-mib", type=int, default=256, help="bytes per version on S3/moto (256)")
    parser.add_argument("--segment-mib", type=int, default=64, help="segment size (64)")
    parser.add_argument("--read-ahead", type=int, default=4, help="segments read at once, as restore does (4)")
    parser.add_argument("--remote-verify", default="checksum,size",
                        type=lambda s: [v for v in s.split(",") if v in ("checksum", "size")] or ["checksum"],
                        help="RemoteTier verify modes measured, each a row (checksum,size)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; medians reported (3)")
    parser.add_argument("--store", action="store_true",
                        help="also measure AsymStore put_many+commit and restore (compression never)")
    parser.add_argument("--dir", default=str(REPO / "bench-out" / "tier-throughput"),
                        help="directory on the disk under test (default: bench-out/tier-throughput)")
    parser.add_argument("--out", default=str(REPO / "bench-out" / "tier_throughput.json"), help="JSON output")
    parser.add_argument("--plot", default=None, help="PNG output (default: --out with .png)")
    parser.add_argument("--verify-all", action="store_true", help="check read bytes every repetition, not the first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.read_ahead < 1 or args.segment_mib < 1:
        parser.error("--repeat, --read-ahead and --segment-mib must be >= 1")
    for name in ("size_mib", "s3_size_mib"):
        size = getattr(args, name)
        if size < 1 or size % args.segment_mib or size * MIB % DD_BLOCK:
            parser.error(f"--{name.replace('_', '-')} must be a multiple of --segment-mib and of "
                         f"{DD_BLOCK // MIB} (the dd block)")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    plot_path = args.plot or os.path.splitext(args.out)[0] + ".png"

    env: dict[str, Any] = {
        "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
        "dir": os.path.abspath(args.dir), "kernel": platform.release(),
        "transparent_hugepage": read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
        "loadavg_at_start": os.getloadavg(), "git": git_state(), "skipped": {},
        "options": {k: v for k, v in vars(args).items()},
    }
    started = time.perf_counter()
    source = random_bytes(max(args.size_mib, args.s3_size_mib) * MIB, args.seed)
    dd_buf = aligned_random_buffer(DD_BLOCK, args.seed)
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(moto_server()) if "remote-s3" in args.tiers else None
        for case in build_cases(args, dd_buf, env, s3):
            os.makedirs(os.path.join(args.dir, case.key), exist_ok=True)
            record = asyncio.run(run_case(case, source, args))
            if args.store:
                limits = {k: record["median"][k] for k in ("limit_write_gbps", "limit_read_gbps")}
                record["store"] = asyncio.run(store_roundtrip(case, source, args, limits))
            results.append(record)
            gc.collect()
    dd_buf.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    for tmp in _TEMP_DIRS:
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - started
    env["loadavg_at_end"] = os.getloadavg()

    doc = {
        "command": " ".join([sys.executable, *sys.argv]),
        "units": "GB/s = 1e9 bytes/s; *_s = seconds; ratio = tier / limit of the same repetition; medians of "
                 f"{args.repeat} repetitions, every sample under reps",
        "cold_read": "before each disk or file:// read (tier and limit): fdatasync + posix_fadvise(POSIX_FADV_DONTNEED)"
                     " on every file, then the fraction still resident measured with mincore (resident_before_read)",
        "targets": {f"{k}:{d}": t for (k, d), t in TARGETS.items()},
        "verdicts": verdicts(results),
        "environment": env,
        "elapsed_s": elapsed,
        "results": results,
    }
    write_json(args.out, doc)
    print_table(results)
    if env["skipped"]:
        print(f"skipped: {env['skipped']}")
    if "libcuda" in env:
        print(f"kvikio: {env['libcuda']}")
    print(f"cold reads: {doc['cold_read']}")
    plot(results, plot_path, f"asymstore tiers vs device limits, {args.size_mib} MiB ({args.s3_size_mib} MiB on S3) "
                             f"in {args.segment_mib} MiB segments; medians of {args.repeat}\n{os.cpu_count()} CPUs, "
                             f"load {env['loadavg_at_start'][0]:.1f}-{env['loadavg_at_end'][0]:.1f}, disk "
                             f"{os.path.abspath(args.dir)}")
    print(f"wrote {args.out} and {plot_path} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
